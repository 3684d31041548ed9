"""The steps' tags and switches as the tests read them (steps.py holds them)."""
from steps import STEPS

TAGS = {step.id: step.tag for step in STEPS.values() if step.tag}


def has_tag(comment, tag):
    """A comment carries tags in front of its first colon: `# FSDP: ...`, `# offload, FSDP: ...`."""
    if comment is None:
        return False
    return tag in [part.strip() for part in comment.split(":", 1)[0].split(",")]


def switch_pairs(words):
    """[(flag, value)] of a list of switches (steps.py's Step.switches): True for a flag alone."""
    pairs = []
    for index, word in enumerate(words):
        if word.startswith("--"):
            following = words[index + 1] if index + 1 < len(words) else "--"
            pairs.append((word, True if following.startswith("--") else following))
    return pairs
