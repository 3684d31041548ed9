"""Fail at once, with a useful message, when the Hugging Face Hub cannot be reached.

Without this check an offline `from_pretrained` retries for about 30 s and ends in a traceback.
"""
import os
import socket
from contextlib import contextmanager
from urllib.parse import urlparse


class HubUnavailable(SystemExit):
    """A user-facing stop: Python prints the message (no traceback) and exits with status 1."""


def hub_reachable(timeout=3.0):
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    url = urlparse(endpoint)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname, port), timeout=timeout):
            return True
    except OSError:
        return False


def offline():
    """True when HF_HUB_OFFLINE asks the Hugging Face libraries to use their cache only."""
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on")


def require_hub(what):
    """Raise HubUnavailable naming `what` unless the Hub answers or HF_HUB_OFFLINE=1 asks for the cache."""
    if offline():
        return
    if not hub_reachable():
        endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
        raise HubUnavailable(
            f"could not fetch {what} from {endpoint}: the Hub is not reachable from this machine.\n"
            "  Run offline with a preset that needs no network instead:  --preset tiny (images)"
            " or --preset tiny-text (text)\n"
            "  (or, if the files are already in your Hugging Face cache, set HF_HUB_OFFLINE=1)")


@contextmanager
def from_cache_when_offline(what):
    """Around a Hub download: with HF_HUB_OFFLINE=1 and `what` not cached, stop with a message
    that says what is missing and how to get it, instead of the library's traceback."""
    try:
        yield
    except OSError as error:  # datasets: ConnectionError; transformers: OSError
        if not offline():
            raise
        cache = os.environ.get("HF_HOME", "~/.cache/huggingface")
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise HubUnavailable(
            f"HF_HUB_OFFLINE=1, but {what} is not in this machine's Hugging Face cache "
            f"({cache}): {reason}\n"
            "  Fetch it once with network access: run the same command without HF_HUB_OFFLINE=1\n"
            "  (the download is cached), or run offline with a preset that needs no network:"
            "  --preset tiny (images) or --preset tiny-text (text)"
        ) from None
