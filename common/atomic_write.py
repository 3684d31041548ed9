"""Writing result files so that a reader never sees half of one: write beside it, then rename."""
import json
import os
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_path(path):
    """A temporary path beside `path`, renamed to `path` when the block succeeds, removed if not."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + f".{os.getpid()}.tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_json_atomically(path, record):
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(record, indent=2) + "\n")


def write_text_atomically(path, text):
    with atomic_path(path) as tmp:
        tmp.write_text(text)
