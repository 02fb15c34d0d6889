"""A fingerprint of the data code, which every tokenization ``datasets.map`` is given, so its cache follows the code.

Why: ``datasets`` caches the result of ``map`` under a fingerprint of the function and its arguments, but it hashes
a function defined in an importable module by its name, not its code. Without this, a run after an upgrade of
lit-memtrain that changes how examples are tokenized or masked (a loss-mask fix) silently reuses the tokenization
the previous version cached for the same data and tokenizer (and the packed rows cached beside it). The
fingerprint hashes the source of every module of the data package: any change to it starts a fresh cache.
"""

from __future__ import annotations

import hashlib
from functools import cache
from pathlib import Path

__all__ = ["data_code_fingerprint"]

_DATA_PACKAGE = Path(__file__).parent


@cache
def data_code_fingerprint(package: Path = _DATA_PACKAGE) -> str:
    """A hash of the source files of ``package`` (the data package by default), read once per process."""
    digest = hashlib.sha256()
    for path in sorted(package.glob("*.py")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]
