"""The optimizer and schedule of a training run: AdamW with warmup-cosine by default, any other by name, and
bitsandbytes' 8-bit and paged AdamW as a memory technique.

The default, :func:`optimizer_and_schedule`: AdamW (the fused kernel where it runs) with no weight decay on biases
and norm weights, stepped every optimizer step by a linear warmup then a cosine decay. Another optimizer or
schedule is given as a LightningCLI-style ``{"class_path": ..., "init_args": {...}}`` spec.

Why 8-bit and paged AdamW: AdamW keeps two fp32 moments per parameter, 8 bytes, twice the bf16 weights
themselves. bitsandbytes' 8-bit AdamW stores them in 8 bits (block-wise quantised: about 2 bytes per parameter),
and its paged variants let the optimizer state spill to host memory under pressure instead of running out of
memory. They run on CUDA only, and bitsandbytes is an optional dependency (``pip install 'lit-memtrain[quant]'``):
the classes here keep the names importable everywhere and give a clear error where they cannot run.

With ``lit-memtrain fit``::

    --optimizer=lit_memtrain.objectives.optim.AdamW8bit --optimizer.lr=2e-5 --optimizer.weight_decay=0.0
    --optimizer=torch.optim.SGD --optimizer.lr=0.1 --optimizer.momentum=0.9

In Python: ``CausalLMModule(optimizer={"class_path": "lit_memtrain.objectives.optim.PagedAdamW8bit",
"init_args": {...}})``.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn

__all__ = [
    "AdamW8bit",
    "PagedAdamW",
    "PagedAdamW8bit",
    "fused_adamw_supported",
    "instantiate",
    "optimizer_and_schedule",
    "plain_spec",
    "scale_gradients",
    "warmup_cosine",
]


@torch.no_grad()
def scale_gradients(parameters: Iterable[torch.nn.Parameter], factor: float) -> None:
    """Multiply every gradient of ``parameters`` by ``factor`` in place (what an accumulation window closed early
    needs: its micro-batches' losses were divided by the full window's count, the mean wants their own)."""
    for parameter in parameters:
        if parameter.grad is not None:
            parameter.grad.mul_(factor)


def instantiate(spec: Mapping[str, Any], *args: Any) -> Any:
    """``class_path(*args, **init_args)`` from a LightningCLI-style ``{"class_path": ..., "init_args": {...}}``;
    a bare class name is looked up in ``torch.optim`` / ``torch.optim.lr_scheduler``."""
    class_path = spec.get("class_path")
    if not isinstance(class_path, str) or not class_path:
        raise ValueError(
            f"An optimizer or scheduler needs a 'class_path' such as 'torch.optim.SGD', got {dict(spec)!r}."
        )
    module_name, _, name = class_path.rpartition(".")
    candidates = [module_name] if module_name else ["torch.optim", "torch.optim.lr_scheduler"]
    for candidate in candidates:
        found = getattr(importlib.import_module(candidate), name, None)
        if found is not None:
            return found(*args, **dict(spec.get("init_args") or {}))
    raise ValueError(f"Cannot find {class_path!r}: give the full import path, for example 'torch.optim.SGD'.")


def plain_spec(spec: Any) -> dict[str, Any] | None:
    """A ``{"class_path", "init_args"}`` spec (dict or jsonargparse namespace) as nested plain dicts: LightningCLI
    links ``--optimizer`` / ``--lr_scheduler`` as namespaces, and the hyper-parameters a checkpoint keeps are plain."""
    if spec is None:
        return None
    as_dict = spec.as_dict() if hasattr(spec, "as_dict") else dict(spec)
    return {"class_path": as_dict["class_path"], "init_args": dict(as_dict.get("init_args") or {})}


def fused_adamw_supported(params: list[Tensor]) -> bool:
    """The fused AdamW kernel (one kernel for all parameters, ~3x faster than the per-tensor loop) runs on
    plain tensors of these device types; sharded DTensor parameters keep the default implementation."""
    from torch.distributed.tensor import DTensor

    return bool(params) and all(
        p.device.type in ("cpu", "cuda", "xpu", "mps") and p.is_floating_point() and not isinstance(p, DTensor)
        for p in params
    )


def warmup_cosine(
    optimizer: torch.optim.Optimizer, warmup: float, min_lr_ratio: float, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """``warmup`` steps (an int, or a fraction of ``total_steps`` when below 1) of linear warmup, then a cosine
    decay to ``min_lr_ratio`` times each group's learning rate at the last step."""
    warmup_steps = int(warmup * total_steps) if warmup < 1 else int(warmup)

    def lr_factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)


def optimizer_and_schedule(
    named_parameters: Iterable[tuple[str, nn.Parameter]],
    *,
    learning_rate: float,
    weight_decay: float,
    betas: tuple[float, float],
    warmup: float,
    min_lr_ratio: float,
    optimizer: Mapping[str, Any] | None,
    lr_scheduler: Mapping[str, Any] | None,
    stepping_batches: Callable[[], float],
    scaler_clips_gradients: Callable[[], bool],
) -> dict[str, Any]:
    """What a LightningModule's ``configure_optimizers`` returns: AdamW (or ``optimizer``) over the trainable
    parameters, with no weight decay on biases and norm weights (those of fewer than 2 dimensions), stepped every
    optimizer step by :func:`warmup_cosine` (or ``lr_scheduler``).

    Args:
        named_parameters: the module's parameters; those that do not require gradients are left out.
        learning_rate, weight_decay, betas: the default AdamW's; ``optimizer``'s own init args apply instead
            (its weight decay to the decayed group).
        warmup, min_lr_ratio: the warmup-cosine schedule's (see :func:`warmup_cosine`).
        optimizer, lr_scheduler: ``{"class_path": ..., "init_args": {...}}`` specs, or ``None`` for the defaults.
        stepping_batches: the run's optimizer steps (Lightning's ``trainer.estimated_stepping_batches``), asked
            for by the warmup-cosine schedule only: estimating them can load the training dataloader early.
        scaler_clips_gradients: whether an fp16 GradScaler will unscale the gradients to clip them, which an
            optimizer that unscales them itself (fused AdamW) does not allow; asked for only where the fused
            kernel could run.
    """
    trainable = [(n, p) for n, p in named_parameters if p.requires_grad]
    low_precision = [(n, p.dtype) for n, p in trainable if p.dtype in (torch.bfloat16, torch.float16)]
    if low_precision:
        name, dtype = low_precision[0]
        rank_zero_warn(
            f"{len(low_precision)} trainable parameters are {dtype} (e.g. {name}): AdamW updates "
            "them in place in that precision, which rounds away updates smaller than about 1/256 of a weight "
            "(most updates at learning rates below ~1e-4). For full fine-tuning prefer dtype='float32' with "
            "Trainer(precision='bf16-mixed'), or train a LoRA adapter (its weights stay fp32)."
        )
    decay = [p for _, p in trainable if p.ndim >= 2]
    no_decay = [p for _, p in trainable if p.ndim < 2]
    if optimizer:  # its own init args, weight_decay included, apply to the decayed group
        built = instantiate(optimizer, [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}])
    else:
        params = [p for _, p in trainable]
        built = torch.optim.AdamW(
            [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=learning_rate,
            betas=tuple(betas),
            fused=fused_adamw_supported(params) and not scaler_clips_gradients(),
        )
    if lr_scheduler:
        scheduler = instantiate(lr_scheduler, built)
        config = {"scheduler": scheduler, "interval": "step"}
        if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            config["monitor"] = getattr(scheduler, "monitor", "train/loss")
        return {"optimizer": built, "lr_scheduler": config}
    scheduler = warmup_cosine(built, warmup, min_lr_ratio, max(1, int(stepping_batches())))
    return {"optimizer": built, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _bitsandbytes(name: str, params: Iterable[Any], **kwargs: Any) -> torch.optim.Optimizer:
    params = list(params)
    tensors = [p for group in params for p in (group["params"] if isinstance(group, dict) else [group])]
    devices = sorted({tensor.device.type for tensor in tensors})
    if not torch.cuda.is_available() or devices != ["cuda"]:
        raise RuntimeError(
            f"lit_memtrain.objectives.optim.{name} (bitsandbytes) runs on CUDA only; the parameters are on "
            f"{devices or 'no device'}"
            f"{'' if torch.cuda.is_available() else ' and this machine has no CUDA'}. Use torch.optim.AdamW (the "
            "default) elsewhere."
        )
    if importlib.util.find_spec("bitsandbytes") is None:
        raise RuntimeError(
            f"lit_memtrain.objectives.optim.{name} needs bitsandbytes: pip install 'lit-memtrain[quant]'."
        )
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
