"""One rank of a sharded or context-parallel step, set up on fake tensors for :mod:`lit_memtrain.planner.step`.

Why this is simulated and not computed: with FSDP2 what one GPU holds depends on the rank count and on what
lives in host memory (1/N shards of parameters, gradients and AdamW state, or none of them with
``cpu_offload``; the layer being gathered; the root kept gathered; the all-gather and reduce-scatter
buffers); with context parallelism it also depends on what the attention exchange keeps for backward. Each is
done here by the code a run uses, on fake tensors, as rank 0 of a fake process group of ``world_size`` ranks
(every rank holds the same, up to padding; collectives move no data, their buffers are allocated as on a GPU):

- the mesh is the strategies' own (:class:`~lit_memtrain.parallel.dims.ParallelDims`: ``data_parallel``, then
  ``context_parallel`` innermost when sequences are split), and the model is sharded over every rank by
  :func:`~lit_memtrain.parallel.fsdp.parallelize` with the strategy's ``MixedPrecisionPolicy`` and
  ``CPUOffloadPolicy``, as ``FSDP2Strategy`` and ``ContextParallelStrategy`` do;
- with ``context_parallel_size > 1`` the batch is cut by
  :func:`~lit_memtrain.parallel.context_parallel.shard_batch` (``sequence / cp`` tokens per rank after the padding the
  method needs) and the attention is :func:`~lit_memtrain.parallel.context_parallel.install_attention`'s:
  Ulysses' all-to-alls (each rank attends over the whole sequence with ``heads / cp`` heads, inner kernel
  ``sdpa_by_document``), or ring's all-gathered keys and values (``ring_backend="all_gather"``, the
  document-aware path: the whole row's K/V per layer, kept for backward unless the layer is checkpointed;
  torch's CUDA ring for single-document rows keeps one rotating K/V block instead, so this is its upper bound).

What stands in for what the CPU cannot run: SDPA on the stand-in device runs as the O(L) flash kernel, as it
does on CUDA (its math fallback would build L x L weights that no GPU run builds), and a lower-right causal
mask (ring blocks that start inside a document) is its causal flag, the same memory. The values that only
serve checks are not simulated: the once-per-batch position check of the installed attention is switched off
(``set_layout(..., check_positions=False)``) and the document-isolation probe is marked done (both read values
fake tensors do not have).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy
from torch.nn.attention.bias import CausalBias

from lit_memtrain.parallel.context_parallel import check_context_parallel, install_attention, shard_batch
from lit_memtrain.parallel.fsdp import mixed_precision_policy, parallelize
from lit_memtrain.planner.settings import StrategySpec
from lit_memtrain.planner.sharded import fake_process_group
from lit_memtrain.planner.simulate import STAND_IN_DEVICE, stand_in_device

__all__ = ["RankSetup", "check_strategy", "device_mesh", "flash_sdpa", "set_up_rank", "shard_model"]


@dataclass
class RankSetup:
    """What a simulated rank holds beyond the model: its batch and the installed context-parallel attention."""

    batch: dict[str, Tensor]
    attention: Any = None
    notes: tuple[str, ...] = ()

    def uninstall(self) -> None:
        if self.attention is not None:
            self.attention.uninstall()


def check_strategy(strategy: StrategySpec, model_config: Any) -> None:
    """The context-parallel sizes must work for this model (before any simulation)."""
    if strategy.context_parallel_size > 1:
        check_context_parallel(
            model_config, strategy.context_parallel_size, strategy.context_parallel_method, strategy.world_size
        )


def device_mesh(strategy: StrategySpec) -> tuple[DeviceMesh, DeviceMesh]:
    """The strategy's device mesh, as rank 0 of a fake process group, and the 1-D mesh FSDP2 shards over (both
    from :meth:`~lit_memtrain.parallel.dims.ParallelDims.build_meshes`). Made outside ``FakeTensorMode``: a mesh
    reads the values of its rank tensor."""
    fake_process_group(strategy.world_size)
    return strategy.parallel_dims.build_meshes(stand_in_device().type)


def shard_model(model: torch.nn.Module, flat_mesh: DeviceMesh, strategy: StrategySpec) -> None:
    """Shard ``model`` (on the stand-in device) over every rank as the strategy would."""
    model.tie_weights()
    parallelize(
        model,
        flat_mesh,
        mp_policy=mixed_precision_policy(strategy.mixed_precision),
        offload_policy=CPUOffloadPolicy(pin_memory=False) if strategy.cpu_offload else None,
        reshard_after_forward=strategy.reshard_after_forward,
    )


def set_up_rank(
    model: torch.nn.Module, mesh: DeviceMesh | None, strategy: StrategySpec, batch: dict[str, Tensor]
) -> RankSetup:
    """Rank 0's batch (its sequence shard under context parallelism) and attention.

    ``batch`` is the whole micro-batch (``input_ids``, ``labels``): with context parallelism real CPU tensors,
    from which the shard is cut by the real :func:`shard_batch` and made fake on the stand-in device (call inside
    ``FakeTensorMode``); without, the fake batch itself.
    """
    cp = strategy.context_parallel_size
    if cp == 1:
        return RankSetup(batch)
    method = strategy.context_parallel_method
    attention = install_attention(model, mesh["context_parallel"].get_group(), method, ring_backend="all_gather")
    with unset_fake_temporarily():  # real CPU tensors: values are read
        shard = shard_batch(batch, 0, cp, method)
        # The local batch below takes the shard's position ids, and the check compares values fake tensors lack.
        attention.set_layout(shard.layout, check_positions=False)
    # The shard's targets are already shifted; the module shifts the labels it is given once more, which moves
    # no memory (the same [B, L / cp] tensor).
    local = {
        "input_ids": _fake_copy(shard.batch["input_ids"]),
        "labels": _fake_copy(shard.batch["shift_labels"]),
        "position_ids": _fake_copy(shard.batch["position_ids"]),
    }
    layout = shard.layout
    kept = (
        "all-gathers the whole row's keys and values in each layer"
        if method == "ring"
        else f"gives it every token of 1/{cp} of the heads in each layer"
    )
    note = (
        f"Context parallelism ({method}, {cp} ranks per sequence): this rank holds {layout.local_length:,} of "
        f"{layout.length:,} tokens per row ({layout.padding:,} tokens of padding added), and its attention "
        f"exchange {kept}."
    )
    notes = [note]
    if method == "ring" and strategy.ring_backend != "all_gather":
        notes.append(
            f"ring_backend={strategy.ring_backend!r} (torch's ring kernels, CUDA) keeps one rotating block of keys and "
            "values instead of the whole row's: the plan simulates the all-gather backend, an upper bound for it."
        )
    return RankSetup(local, attention, tuple(notes))


def _fake_copy(tensor: Tensor) -> Tensor:
    """A fake tensor of ``tensor``'s shape and dtype on the stand-in device (values are not simulated)."""
    return torch.empty(tensor.shape, dtype=tensor.dtype, device=stand_in_device())


@contextmanager
def flash_sdpa() -> Iterator[None]:
    """Run ``F.scaled_dot_product_attention`` on the stand-in device as the O(L) flash kernel (see the module
    docstring). Patched on ``torch.nn.functional`` rather than caught by a mode, so that it also holds in
    backward's recomputation of checkpointed layers, which runs on autograd's device thread."""
    original = F.scaled_dot_product_attention

    def scaled_dot_product_attention(query: Tensor, key: Tensor, value: Tensor, attn_mask: Any = None,
                                     dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                                     enable_gqa: bool = False) -> Tensor:  # fmt: skip
        if query.device.type != STAND_IN_DEVICE:
            return original(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
        if not (is_causal or isinstance(attn_mask, CausalBias)):
            raise ValueError("The simulation runs SDPA on its stand-in device for causal attention only.")
        # A lower-right causal bias (a ring block starting inside its document) is the causal flag's memory.
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, dropout_p, True, scale=scale
        )[0]  # grouped key/value heads are taken as they are

    F.scaled_dot_product_attention = scaled_dot_product_attention
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original
