"""Library warnings that say nothing a user of these scripts can act on, silenced one by one,
each by its own words and where it comes from (nothing else from those libraries is hidden):

- PyTorch's MemTracker (the meter's tracker) when a module it hooked is gone by the time its
  backward hook runs ("Module is None. Skipping PRE_BW hook.") and when an output it tracks is
  None ("Expected a tensor ... but got <class 'NoneType'>"): it skips them, as it should;
- torch.compile's advice on checkpointing with a context_fn (05d's and 10's selective policy),
  that the region hold no in-place operation: theirs hold none;
- bitsandbytes, on a CPU with AVX-512 BF16, that it could not load an optional faster 4-bit CPU
  kernel from the `kernels` package (its own CPU kernel runs instead).

The `common` package applies them as it is imported, before a script imports bitsandbytes.
"""
import logging
import warnings

SILENCED_LOGS = {  # logger: words of the one message silenced
    "torch._higher_order_ops.wrap": "context_fn is passed to torch.utils.checkpoint under torch.compile",
    "bitsandbytes.backends.cpu.ops": "Failed to load CPU gemm_4bit_forward from kernels-community",
}


class Without(logging.Filter):
    """Drops the records whose message holds `words`."""

    def __init__(self, words):
        super().__init__()
        self.words = words

    def filter(self, record):
        return self.words not in record.getMessage()


def silence():
    """Silence the warnings above (once; calling again adds nothing)."""
    warnings.filterwarnings("ignore", message=r"Module is None\. Skipping (PRE|POST)_BW hook\.",
                            category=UserWarning, module=r"torch\.distributed\._tools\.mod_tracker")
    warnings.filterwarnings("ignore", message=r"Expected a tensor or a traceable wrapper-subclass "
                            r"of tensor, but got <class 'NoneType'>", category=UserWarning,
                            module=r"torch\.distributed\._tools\.mem_tracker")
    for name, words in SILENCED_LOGS.items():
        logger = logging.getLogger(name)
        if not any(isinstance(each, Without) and each.words == words for each in logger.filters):
            logger.addFilter(Without(words))
