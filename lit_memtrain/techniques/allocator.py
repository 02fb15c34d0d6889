"""CUDA caching-allocator settings for long sequences.

Why: at long context the step allocates and frees tensors of many different large sizes (per-layer
recomputation, logit chunks, offloaded activations coming back). With the default allocator the freed
blocks fragment the reserved memory, and a run at 1M tokens fails with an out-of-memory error although
enough memory is free in total. ``expandable_segments:True`` lets the allocator grow one segment per stream
instead of caching fixed-size blocks, which removes most of that fragmentation.

The setting is read once, when CUDA initialises, so it must be in the environment before the first CUDA
call. PyTorch 2.10 renamed ``PYTORCH_CUDA_ALLOC_CONF`` to ``PYTORCH_ALLOC_CONF``; both are set so the
setting works with every supported version. A value the user set in either variable is always kept.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

EXPANDABLE_SEGMENTS = "expandable_segments:True"
ALLOC_CONF_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")

__all__ = ["ALLOC_CONF_VARIABLES", "EXPANDABLE_SEGMENTS", "enable_expandable_segments"]


def enable_expandable_segments(environ: MutableMapping[str, str] | None = None) -> bool:
    """Set ``PYTORCH_CUDA_ALLOC_CONF`` and ``PYTORCH_ALLOC_CONF`` to ``expandable_segments:True``.

    Nothing changes when the user has set either variable (even to an empty string). Call this before
    anything touches CUDA (at the top of an entry point); it has no effect on an initialised CUDA context.

    Args:
        environ: the environment to change; ``os.environ`` when omitted.

    Returns:
        ``True`` if the variables were set, ``False`` if a user setting was kept.
    """
    environ = os.environ if environ is None else environ
    if any(name in environ for name in ALLOC_CONF_VARIABLES):
        return False
    for name in ALLOC_CONF_VARIABLES:
        environ[name] = EXPANDABLE_SEGMENTS
    return True
