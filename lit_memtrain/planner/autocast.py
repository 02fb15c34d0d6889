"""CUDA's autocast, on the simulation's stand-in device.

Why: under ``precision="bf16-mixed"`` (Lightning's ``torch.autocast("cuda", torch.bfloat16)``) the weights
stay fp32 while matmuls compute in bf16: activations are half the size of fp32 ones, and each weight is
cast to a bf16 copy that autocast caches until the autocast region ends. Simulating that step in fp32, or
in bf16 throughout, would be wrong by up to 2x on activations. PyTorch registers autocast kernels for CUDA,
CPU, XPU, MPS and a few others, but none for a PrivateUse1 device such as the planner's ``gpu``: there,
``torch.autocast("gpu", ...)`` turns autocast on and the first matmul fails.

What this module registers, once per process, for the ``AutocastPrivateUse1`` dispatch key:
- a fallthrough for every operator, as PyTorch does for its own autocast keys;
- CUDA's policy for the operators a causal LM step runs (PyTorch's "Autocast Op Reference" for CUDA):
  matmuls, linear layers and attention kernels run in the autocast dtype; pointwise transcendental ops,
  norms and losses run in fp32; reductions such as ``sum`` and ``softmax`` produce fp32 without copying their
  input (CUDA's "set optional dtype" ops). The simulated attention kernel (the CPU flash op that stands in
  for flash attention) is treated like CUDA's attention kernels.
- CUDA's weight cache: a cast of an fp32 leaf tensor that requires grad (a weight) to the autocast dtype is
  made once and kept until the outermost autocast region exits: for Lightning's ``MixedPrecision``, the
  ``training_step``; in backward, each checkpointed layer's recomputation. PyTorch empties its own cache
  through ``torch.clear_autocast_cache()`` when that region exits, so the emulation empties its cache there
  too (``torch.clear_autocast_cache`` is wrapped, in this process only). Keeping the same casts matters twice:
  the copies' memory, and selective checkpointing, which replays forward's operations in backward one by
  one and fails if the recomputation casts a weight that forward found in the cache.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Any

import torch
from torch import Tensor

__all__ = ["register_stand_in_autocast"]

_LOWER_PRECISION = (
    "mm", "addmm", "addmv", "addr", "matmul", "einsum", "mv", "linear", "addbmm", "baddbmm", "bmm",
    "chain_matmul", "linalg_multi_dot", "linalg_vecdot", "prelu", "conv1d", "conv2d", "conv3d", "convolution",
    "_convolution", "scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention_for_cpu",
)  # fmt: skip
_FP32 = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
    "sinh", "tan", "pow", "softplus", "layer_norm", "native_layer_norm", "group_norm", "norm", "nll_loss",
    "nll_loss_nd", "nll_loss2d", "cross_entropy_loss", "binary_cross_entropy_with_logits", "kl_div", "l1_loss",
    "smooth_l1_loss", "huber_loss", "mse_loss", "cosine_similarity", "cdist", "pdist", "dist", "renorm",
)  # fmt: skip
_FP32_OUTPUT = ("sum", "prod", "cumsum", "cumprod", "softmax", "log_softmax", "linalg_vector_norm")

_state: dict[str, Any] = {"device_type": None, "libraries": None}
_cache: dict[int, tuple[weakref.ref, Tensor]] = {}


def _eligible(value: Any, device_type: str) -> bool:
    return (
        isinstance(value, Tensor)
        and value.is_floating_point()
        and value.dtype != torch.float64
        and value.device.type == device_type
    )


def _cast(value: Any, dtype: torch.dtype, device_type: str) -> Any:
    if isinstance(value, (list, tuple)):
        return type(value)(_cast(item, dtype, device_type) for item in value)
    if not _eligible(value, device_type) or value.dtype == dtype:
        return value
    cacheable = value.requires_grad and value.is_leaf and not value._is_view() and value.dtype == torch.float32
    if not (cacheable and dtype != torch.float32 and torch.is_autocast_cache_enabled()):
        return value.to(dtype)
    known = _cache.get(id(value))
    if known is not None and known[0]() is value:
        return known[1]
    cast = value.to(dtype)
    _cache[id(value)] = (weakref.ref(value), cast)
    return cast


def _without_autocast() -> contextlib.AbstractContextManager:
    return torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastPrivateUse1))


def _lower_precision_kernel(op: torch._ops.OpOverload, device_type: str):
    def kernel(*args: Any, **kwargs: Any) -> Any:
        dtype = torch.get_autocast_dtype(device_type)
        args = tuple(_cast(arg, dtype, device_type) for arg in args)
        kwargs = {name: _cast(value, dtype, device_type) for name, value in kwargs.items()}
        with _without_autocast():
            return op(*args, **kwargs)

    return kernel


def _fp32_kernel(op: torch._ops.OpOverload, device_type: str):
    def kernel(*args: Any, **kwargs: Any) -> Any:
        args = tuple(_cast(arg, torch.float32, device_type) for arg in args)
        kwargs = {name: _cast(value, torch.float32, device_type) for name, value in kwargs.items()}
        with _without_autocast():
            return op(*args, **kwargs)

    return kernel


def _fp32_output_kernel(op: torch._ops.OpOverload, device_type: str):
    names = [argument.name for argument in op._schema.arguments]
    position = names.index("dtype") if "dtype" in names else None

    def kernel(*args: Any, **kwargs: Any) -> Any:
        if position is not None and args and _eligible(args[0], device_type):
            if len(args) > position:  # passed by position (``tensor.softmax(dim, dtype)``)
                if args[position] is None:
                    args = (*args[:position], torch.float32, *args[position + 1 :])
            elif kwargs.get("dtype") is None:
                kwargs = {**kwargs, "dtype": torch.float32}
        with _without_autocast():
            return op(*args, **kwargs)

    return kernel


def register_stand_in_autocast(device_type: str) -> None:
    """Register CUDA's autocast policy for ``device_type``, a PrivateUse1 device (once per process)."""
    if _state["device_type"] == device_type:
        return
    if _state["device_type"] is not None:
        raise RuntimeError(f"Autocast is already emulated for {_state['device_type']!r} in this process.")
    everything = torch.library.Library("_", "IMPL")
    everything.fallback(torch.library.fallthrough_kernel, "AutocastPrivateUse1")
    aten = torch.library.Library("aten", "IMPL")
    policies = [(_LOWER_PRECISION, _lower_precision_kernel), (_FP32, _fp32_kernel), (_FP32_OUTPUT, _fp32_output_kernel)]
    for names, make_kernel in policies:
        for name in names:
            packet = getattr(torch.ops.aten, name)
            for overload in packet.overloads():
                if "out" in overload.split("_"):
                    continue
                qualified = name if overload == "default" else f"{name}.{overload}"
                aten.impl(qualified, make_kernel(getattr(packet, overload), device_type), "AutocastPrivateUse1")
    clear_autocast_cache = torch.clear_autocast_cache

    @functools.wraps(clear_autocast_cache)
    def clear_autocast_caches() -> None:
        clear_autocast_cache()
        _cache.clear()

    torch.clear_autocast_cache = clear_autocast_caches
    _state.update(device_type=device_type, libraries=(everything, aten))
