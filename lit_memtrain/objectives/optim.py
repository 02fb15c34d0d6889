"""Optimizers chosen by name, and bitsandbytes' 8-bit and paged AdamW as a memory technique.

Why: AdamW keeps two fp32 moments per parameter, 8 bytes, twice the bf16 weights themselves. bitsandbytes'
8-bit AdamW stores them in 8 bits (block-wise quantised: about 2 bytes per parameter), and its paged
variants let the optimizer state spill to host memory under pressure instead of running out of memory.
They run on CUDA only, and bitsandbytes is an optional dependency (``pip install 'lit-memtrain[quant]'``):
the classes here keep the names importable everywhere and give a clear error where they cannot run.

With ``lit-memtrain fit``::

    --optimizer=lit_memtrain.objectives.optim.AdamW8bit --optimizer.lr=2e-5 --optimizer.weight_decay=0.0
    --optimizer=torch.optim.SGD --optimizer.lr=0.1 --optimizer.momentum=0.9

In Python: ``CausalLMModule(optimizer={"class_path": "lit_memtrain.objectives.optim.PagedAdamW8bit", "init_args": {...}})``.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Iterable, Mapping
from typing import Any

import torch

__all__ = ["AdamW8bit", "PagedAdamW", "PagedAdamW8bit", "instantiate"]


def instantiate(spec: Mapping[str, Any], *args: Any) -> Any:
    """``class_path(*args, **init_args)`` from a LightningCLI-style ``{"class_path": ..., "init_args": {...}}``;
    a bare class name is looked up in ``torch.optim`` / ``torch.optim.lr_scheduler``."""
    class_path = spec.get("class_path")
    if not isinstance(class_path, str) or not class_path:
        raise ValueError(f"An optimizer or scheduler needs a 'class_path' such as 'torch.optim.SGD', got {dict(spec)!r}.")
    module_name, _, name = class_path.rpartition(".")
    candidates = [module_name] if module_name else ["torch.optim", "torch.optim.lr_scheduler"]
    for candidate in candidates:
        found = getattr(importlib.import_module(candidate), name, None)
        if found is not None:
            return found(*args, **dict(spec.get("init_args") or {}))
    raise ValueError(f"Cannot find {class_path!r}: give the full import path, for example 'torch.optim.SGD'.")


def _bitsandbytes(name: str, params: Iterable[Any], **kwargs: Any) -> torch.optim.Optimizer:
    params = list(params)
    tensors = [p for group in params for p in (group["params"] if isinstance(group, dict) else [group])]
    devices = sorted({tensor.device.type for tensor in tensors})
    if not torch.cuda.is_available() or devices != ["cuda"]:
        raise RuntimeError(
            f"lit_memtrain.objectives.optim.{name} (bitsandbytes) runs on CUDA only; the parameters are on {devices or 'no device'}"
            f"{'' if torch.cuda.is_available() else ' and this machine has no CUDA'}. Use torch.optim.AdamW (the "
            "default) elsewhere."
        )
    if importlib.util.find_spec("bitsandbytes") is None:
        raise RuntimeError(f"lit_memtrain.objectives.optim.{name} needs bitsandbytes: pip install 'lit-memtrain[quant]'.")
    import bitsandbytes

    return getattr(bitsandbytes.optim, name)(params, **kwargs)


def _bitsandbytes_class(name: str, doc: str) -> type[torch.optim.Optimizer]:
    """A ``torch.optim.Optimizer`` subclass (so LightningCLI's ``--optimizer`` accepts it) whose construction
    returns bitsandbytes' optimizer of that name, after checking that it can run here."""

    def __new__(
        cls: type,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
    ) -> torch.optim.Optimizer:
        return _bitsandbytes(name, params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)

    return type(name, (torch.optim.Optimizer,), {"__new__": __new__, "__doc__": doc, "__module__": __name__})


AdamW8bit = _bitsandbytes_class("AdamW8bit", "bitsandbytes' 8-bit AdamW: the two moments in 8 bits (CUDA only).")
PagedAdamW8bit = _bitsandbytes_class(
    "PagedAdamW8bit", "bitsandbytes' paged 8-bit AdamW: 8-bit moments in memory that pages to the host (CUDA only)."
)
PagedAdamW = _bitsandbytes_class(
    "PagedAdamW", "bitsandbytes' paged AdamW: fp32 moments in memory that pages to the host (CUDA only)."
)
