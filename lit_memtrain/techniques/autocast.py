"""The autocast state to carry from a custom autograd Function's forward into its backward.

Why: PyTorch runs a custom ``backward`` with autocast off. A Function that recomputes part of its forward in
backward (the chunked loss, the tiled MLP) must use the dtypes forward used, or its gradients do not match
its values under ``bf16-mixed``.
"""

from __future__ import annotations

import torch


def active_autocast_dtype(device_type: str) -> torch.dtype | None:
    """The autocast dtype in effect for ``device_type``, or None when autocast is off there."""
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None
