"""Callback enabling the CUDA allocator's expandable segments in a user's own training script.

Why the work happens in ``__init__``: the allocator reads its settings when CUDA initialises, and Lightning
initialises CUDA in ``Trainer.fit`` before any callback hook runs (``setup_environment`` selects the device).
Constructing the callback, which a script does before calling ``fit``, is the last moment the setting can
still take effect. When CUDA is already initialised the callback warns instead of pretending.
"""

from __future__ import annotations

import os

import torch
from lightning.pytorch import Callback
from lightning.pytorch.utilities import rank_zero_warn

from lit_memtrain.techniques.allocator import ALLOC_CONF_VARIABLES, EXPANDABLE_SEGMENTS, enable_expandable_segments

__all__ = ["AllocatorSettings"]


class AllocatorSettings(Callback):
    """Set ``expandable_segments:True`` for the CUDA caching allocator unless the user configured it.

    Construct it before anything touches CUDA (before moving a model or tensor to the GPU). A value the user
    set in ``PYTORCH_CUDA_ALLOC_CONF`` or ``PYTORCH_ALLOC_CONF`` is kept.

    Attributes:
        applied: ``True`` when this callback set the variables in time to take effect.

    Example:
        >>> from lit_memtrain.callbacks.allocator_settings import AllocatorSettings
        >>> trainer = Trainer(callbacks=[AllocatorSettings()])  # doctest: +SKIP
    """

    def __init__(self) -> None:
        self.applied = False
        if any(name in os.environ for name in ALLOC_CONF_VARIABLES):
            return
        if torch.cuda.is_initialized():
            rank_zero_warn(
                f"AllocatorSettings cannot set {EXPANDABLE_SEGMENTS}: CUDA is already initialised and reads the "
                f"allocator settings only once. Export PYTORCH_ALLOC_CONF={EXPANDABLE_SEGMENTS} before starting "
                "Python, or create this callback before anything uses CUDA."
            )
            return
        self.applied = enable_expandable_segments()
