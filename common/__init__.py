"""Building blocks that stay the same in every numbered script: data, model, memory, reporting."""
