"""Forked worker processes for the estimate table and the --gpu-memory search, which Ctrl-C
stops as a whole: the workers ignore it, the parent ends them and says how far it got."""
import gc
import multiprocessing
import signal
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager


@contextmanager
def worker_pool(jobs, interrupted):
    """A pool of `jobs` forked workers (they share the parent's imports, which the collector
    then leaves alone). On Ctrl-C the workers are killed and the run stops with the message
    `interrupted()` returns (called then, so it can say what was done)."""
    gc.freeze()  # imported objects never become garbage: keep them out of the collector's way
    pool = ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork"),
                               initializer=signal.signal, initargs=(signal.SIGINT, signal.SIG_IGN))
    try:
        yield pool
    except KeyboardInterrupt:
        stop(pool)  # mid-estimate: a worker ignoring Ctrl-C would finish its row first
        raise SystemExit(f"\ninterrupted (Ctrl-C) {interrupted()}") from None
    except BrokenProcessPool:
        stop(pool)
        raise SystemExit(f"error: a worker process died (killed: by the system when memory ran "
                         f"out, most often), {interrupted()}. Run again with --jobs 1: one "
                         "estimate at a time holds the least memory") from None
    pool.shutdown()


def stop(pool):
    """End the pool's workers now, and drop what they had not started."""
    for worker in list((getattr(pool, "_processes", None) or {}).values()):
        worker.kill()
    pool.shutdown(wait=False, cancel_futures=True)


def in_order(function, items, jobs, interrupted):
    """function(item) for each of `items`, yielded in their order while up to `jobs` workers
    compute the next ones ahead; closing the generator early stops the work still to do."""
    if jobs <= 1 or len(items) <= 1:
        yield from map(function, items)
        return
    with worker_pool(jobs, interrupted) as pool:
        futures = [pool.submit(function, item) for item in items]
        try:
            for future in futures:
                yield future.result()
        finally:
            if not all(future.done() for future in futures):
                stop(pool)
