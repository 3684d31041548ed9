"""Fail at once, with a useful message, when the Hugging Face Hub cannot be reached.

Without this check an offline `from_pretrained` retries for about 30 s and ends in a traceback.
"""
import os
import socket
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


def require_hub(what):
    """Raise HubUnavailable naming `what` unless the Hub answers or HF_HUB_OFFLINE=1 asks for the cache."""
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes"):
        return
    if not hub_reachable():
        endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
        raise HubUnavailable(
            f"could not fetch {what} from {endpoint}: the Hub is not reachable from this machine.\n"
            "  Run offline with the default preset instead:  --preset tiny\n"
            "  (or, if the files are already in your Hugging Face cache, set HF_HUB_OFFLINE=1)")
