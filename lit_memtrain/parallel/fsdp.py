"""FSDP2 for a Hugging Face causal LM: each decoder layer its own unit, the causal LM the root.

Why this order and these units: ``fully_shard`` gathers a unit's parameters before its forward and frees
them after, so the units decide what is ever unsharded at once. One unit per decoder layer keeps that to
one layer (plus the one being prefetched); the root unit holds what is left (embeddings, final norm, LM
head, tied or not), gathered for the whole forward and backward. Sharding the layers before the root is
what ``fully_shard`` requires (a parent assigns only the parameters no child unit took). LoRA adapters are
applied before (PEFT wraps the model first) and land in their layer's unit, sharded with the frozen base.
Checkpointing, tiled MLPs and activation offloading are applied later by their callbacks, by replacing the
layers' ``forward`` on the instance: FSDP2's hooks stay outside them, as torchtitan orders it.

The root's parameters are unsharded only inside the root's own forward. Code that reads them outside it
(the chunked loss reads ``lm_head.weight`` and calls ``get_decoder()``) must run through
:func:`run_inside_forward`.

:func:`mixed_precision_policy` turns the names a config can hold (``"bf16"``, a dict of dtype names) into the
``MixedPrecisionPolicy`` that ``parallelize`` takes: the strategies and the planner read the same setting the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from lit_memtrain.models.layers import find_decoder_layers

__all__ = ["is_sharded", "mixed_precision_policy", "parallelize", "run_inside_forward"]

T = TypeVar("T")

_DTYPE_NAMES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "fp16": torch.float16,
    "float16": torch.float16,
}
_POLICY_FIELDS = ("param_dtype", "reduce_dtype", "output_dtype")


def _dtype(value: Any, field: str) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        return value
    if value not in _DTYPE_NAMES:
        raise ValueError(f"mixed_precision {field}={value!r} is not a dtype name; use one of {sorted(_DTYPE_NAMES)}.")
    return _DTYPE_NAMES[value]


def mixed_precision_policy(value: str | dict[str, Any] | MixedPrecisionPolicy | None) -> MixedPrecisionPolicy | None:
    """The FSDP2 policy for a ``mixed_precision`` setting (``FSDP2Strategy(mixed_precision=...)``, a plan's).

    A dtype name (``"bf16"``) gathers parameters in that dtype for compute and reduces gradients in fp32; a
    dict names the policy's fields (``{"param_dtype": "bfloat16", "reduce_dtype": "float32"}``); a policy is
    taken as it is and ``None`` is no policy (compute in the parameters' dtype).

    Raises:
        ValueError: an unknown dtype name or field, or float16 (it would need loss scaling).
        TypeError: a value of another type.

    Example:
        >>> mixed_precision_policy("bf16").param_dtype, mixed_precision_policy("bf16").reduce_dtype
        (torch.bfloat16, torch.float32)
    """
    if value is None or isinstance(value, MixedPrecisionPolicy):
        policy = value
    elif isinstance(value, str):
        policy = MixedPrecisionPolicy(param_dtype=_dtype(value, "param_dtype"), reduce_dtype=torch.float32)
    elif isinstance(value, dict):
        unknown = set(value) - {*_POLICY_FIELDS, "cast_forward_inputs"}
        if unknown:
            known = [*_POLICY_FIELDS, "cast_forward_inputs"]
            raise ValueError(f"mixed_precision has unknown fields {sorted(unknown)}; known: {known}.")
        dtypes = {field: _dtype(value.get(field), field) for field in _POLICY_FIELDS}
        policy = MixedPrecisionPolicy(**dtypes, cast_forward_inputs=bool(value.get("cast_forward_inputs", True)))
    else:
        raise TypeError(
            f"mixed_precision must be a dtype name such as 'bf16', a dict of MixedPrecisionPolicy fields, a "
            f"MixedPrecisionPolicy or None; got {type(value).__name__}."
        )
    if policy is not None and torch.float16 in (policy.param_dtype, policy.reduce_dtype):
        raise ValueError(
            "mixed_precision with float16 needs loss scaling, which FSDP2Strategy does not provide: use 'bf16'."
        )
    return policy


def parallelize(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    mp_policy: MixedPrecisionPolicy | None = None,
    offload_policy: OffloadPolicy | None = None,
    reshard_after_forward: bool = True,
    layers_path: str | None = None,
) -> nn.Module:
    """Shard ``model`` with FSDP2 over ``mesh``: every decoder layer, then the whole model as the root.

    Args:
        model: a Hugging Face causal LM (or a PEFT model around one), on the meta device or materialised.
        mesh: the 1-D device mesh to shard over.
        mp_policy: FSDP2 mixed precision (dtype parameters are gathered in, dtype gradients are reduced in).
        offload_policy: ``CPUOffloadPolicy`` to keep sharded parameters, gradients and optimizer state in
            host memory.
        reshard_after_forward: free each layer's gathered parameters after its forward and gather them
            again for backward (``False`` keeps them, trading memory for one all-gather per layer). The root
            keeps its parameters through backward either way, since backward starts with them.
        layers_path: dotted path to the decoder layers when they cannot be found automatically.

    Returns:
        ``model`` itself, now an ``FSDPModule`` whose parameters are ``DTensor`` shards.

    Example:
        >>> mesh = init_device_mesh("cuda", (8,), mesh_dim_names=("data_parallel",))  # doctest: +SKIP
        >>> model = parallelize(model, mesh, mp_policy=MixedPrecisionPolicy(torch.bfloat16, torch.float32))  # doctest: +SKIP
    """
    if mesh.ndim != 1:
        raise ValueError(f"parallelize shards over a 1-D mesh; got a {mesh.ndim}-D mesh {mesh.mesh_dim_names}.")
    options: dict[str, Any] = {"mesh": mesh}
    if mp_policy is not None:
        options["mp_policy"] = mp_policy
    if offload_policy is not None:
        options["offload_policy"] = offload_policy
    for layer in find_decoder_layers(model, layers_path):
        fully_shard(layer, reshard_after_forward=reshard_after_forward, **options)
    fully_shard(model, reshard_after_forward=None if reshard_after_forward else False, **options)
    return model


def is_sharded(model: nn.Module | None) -> bool:
    """Whether ``model`` is the root of an FSDP2 model."""
    return isinstance(model, FSDPModule)


def run_inside_forward(module: nn.Module, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Call ``fn(*args, **kwargs)`` as ``module``'s forward, inside its hooks.

    Under FSDP2 a module's parameters are gathered by its forward pre-hook and its backward is registered on
    what its forward returns: running ``fn`` this way lets it read the root's parameters (the LM head, tied
    embeddings) and call its submodules directly, and the whole step's parameters are then gathered once,
    not once per call. The ``forward`` set on the instance is restored afterwards.
    """
    previous = vars(module).get("forward")
    module.forward = fn
    try:
        return module(*args, **kwargs)
    finally:
        if previous is None:
            del module.forward
        else:
            module.forward = previous
