"""Python's garbage collector while estimates run: what lives frozen, so that the collection each
run's measure_creation starts with (common/memory.py) scans only what the run made, not every
object torch, transformers and the scripts imported (a third of a second a run in a test worker).

One helper for every place that freezes (the workers' pool, the fake runs, the tests), nested by
a count rather than by asking gc.get_freeze_count(), which walks every frozen object (30 ms in an
estimate's worker, 0.1 s in a test worker) each time it is asked.
"""
import gc
from contextlib import contextmanager

depth = 0  # frozen() blocks entered and not left, in this process (a forked worker inherits it)


@contextmanager
def frozen(collect=True):
    """What lives now frozen while inside, and thawed when the outermost block is left. Where
    `collect`, garbage is freed first (frozen, it would wait for the thaw): a full scan in the
    outermost block, in an inner one a scan of what was made since the last freeze only."""
    global depth
    depth += 1  # (first: a Ctrl-C after the freeze must find the count that thaws it)
    try:
        if collect:
            gc.collect()
        gc.freeze()
        yield
    finally:
        depth -= 1
        if depth == 0:
            gc.unfreeze()
