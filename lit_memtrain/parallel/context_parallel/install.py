"""Put context-parallel attention into a transformers model, and take it out again.

Why an attention implementation: transformers calls every attention layer through ``AttentionInterface``
with the projected queries, keys and values, after RoPE. Registering Ulysses and ring there
(``attn_implementation="lit_memtrain_ulysses"`` / ``"lit_memtrain_ring"``) exchanges exactly what must cross
ranks and leaves the rest of the model (norms, MLPs, tiled MLPs, checkpointing, LoRA, FSDP2) local and
untouched.

Why no mask: the mask function registered for these names builds nothing (no O(L^2) mask, and no misreading
of a shard's position ids: with head-tail order a rank's positions ``[0..7, 24..31]`` look like two packed
documents to transformers). It refuses a padding mask rather than drop it: without a mask function of its
own, transformers would silently ignore the mask passed to the model. The document bounds come from
the whole row instead: :meth:`ContextParallelAttention.set_layout` with each batch's
:class:`~lit_memtrain.parallel.context_parallel.sharding.ShardLayout`. The layout stays set until the next one, so it is
still there when backward recomputes checkpointed layers; every call checks that the layout fits the tensors
it gets, so a stale one raises rather than mixing rows.

How the model is called on a shard: ``model(input_ids=shard["input_ids"], position_ids=shard["position_ids"],
use_cache=False)``: global position ids (RoPE and YaRN rotate each token as on one process), no
``attention_mask``, no cache. The loss takes ``shard["shift_labels"]`` as they are (already shifted).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from lit_memtrain.techniques.attention import (
    FLASH_ATTN_MAX_HEAD_DIM,
    SDPA_BY_DOCUMENT,
    attention_head_dim,
    check_flash_attn,
)
from lit_memtrain.parallel.context_parallel.ring_attention import AttentionBlock, attention_blocks, gathered_kv_attention
from lit_memtrain.parallel.context_parallel.sharding import ShardLayout
from lit_memtrain.parallel.context_parallel.torch_ring import torch_ring_sdpa
from lit_memtrain.parallel.context_parallel.ulysses import INNER_ATTENTIONS, ulysses_attention
from lit_memtrain.parallel.context_parallel.validation import check_context_parallel

__all__ = ["ATTENTION_NAMES", "RING_BACKENDS", "ContextParallelAttention", "install_attention"]

ATTENTION_NAMES = {"ulysses": "lit_memtrain_ulysses", "ring": "lit_memtrain_ring"}
RING_BACKENDS = ("all_gather", "torch")

# Every submodule of an installed model -> its installation (attention functions receive their module).
_installed: weakref.WeakKeyDictionary[nn.Module, ContextParallelAttention] = weakref.WeakKeyDictionary()


class ContextParallelAttention:
    """Attention of one model split over one context-parallel group; made by :func:`install_attention`.

    Call :meth:`set_layout` with every batch's layout before its forward, and :meth:`uninstall` to restore
    the model's previous attention.
    """

    def __init__(
        self, model: nn.Module, group: dist.ProcessGroup, method: str, inner: str, ring_backend: str, previous: str
    ) -> None:
        # Weak: the registry's values must not keep its keys (the model's modules) alive.
        self._model = weakref.ref(model)
        self.group = group
        self.method = method
        self.inner = inner
        self.ring_backend = ring_backend
        self.previous = previous
        self.layout: ShardLayout | None = None
        self._positions_checked = False
        self._blocks: list[AttentionBlock] = []
        self._size = dist.get_world_size(group)
        self._rank = dist.get_rank(group)

    def set_layout(self, layout: ShardLayout, check_positions: bool = True) -> None:
        """Use ``layout`` (from :func:`~lit_memtrain.parallel.context_parallel.shard_batch`) until the next call.

        Args:
            layout: this rank's layout of the batch about to run.
            check_positions: check, at the batch's first attention call, that the model was called with the
                shard's global ``position_ids`` (one device sync and one all-reduce over the group per batch).
                ``False`` skips it, for a caller that passes them by construction and whose tensors hold no
                values to compare (the planner's fake tensors).
        """
        found = (layout.method, layout.cp_size, layout.cp_rank)
        if found != (self.method, self._size, self._rank):
            raise ValueError(
                f"The batch was sharded for method={found[0]!r}, cp_size={found[1]}, cp_rank={found[2]}, but this "
                f"attention runs {self.method!r} on rank {self._rank} of a group of {self._size}."
            )
        if self.method == "ulysses" and self.inner == "sdpa" and layout.num_documents > 1:
            raise ValueError(
                f"inner attention 'sdpa' is one causal call over the row, but this row holds {layout.num_documents} "
                f"segments (packed documents, or a collator's padding): they would attend to each other. Use "
                f"inner={SDPA_BY_DOCUMENT!r} or 'flash_attention_2'."
            )
        self.layout = layout
        self._positions_checked = not check_positions
        if self.method == "ring" and self.ring_backend == "all_gather":
            self._blocks = attention_blocks(layout)

    def uninstall(self) -> None:
        """Restore the model's previous attention implementation."""
        model = self._model()
        if model is None:
            return
        for module in model.modules():
            if _installed.get(module) is self:
                del _installed[module]
        model.set_attn_implementation(self.previous)

    def __call__(
        self,
        module: nn.Module,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        scaling: float | None = None,
        dropout: float = 0.0,
        **kwargs: Any,
    ) -> tuple[Tensor, None]:
        layout = self._checked_layout(module, query, key, attention_mask, kwargs)
        if self.method == "ulysses":
            output = ulysses_attention(module, query, key, value, layout, self.group, self.inner, scaling, dropout)
        elif self.ring_backend == "torch":
            output = torch_ring_sdpa(query, key, value, layout, scaling, dropout)
        else:
            output = gathered_kv_attention(query, key, value, layout, self._blocks, self.group, scaling, dropout)
        return output, None

    def _checked_layout(
        self, module: nn.Module, query: Tensor, key: Tensor, attention_mask: Tensor | None, kwargs: dict[str, Any]
    ) -> ShardLayout:
        name = type(module).__name__
        if attention_mask is not None:
            raise ValueError(
                f"{name} got an attention mask, which context-parallel attention cannot honour (it covers the local "
                "shard only). Call the model without attention_mask, on batches from shard_batch."
            )
        unsupported = [k for k in ("sliding_window", "softcap", "s_aux") if kwargs.get(k) is not None]
        if unsupported or not kwargs.get("is_causal", getattr(module, "is_causal", True)):
            raise ValueError(
                f"{name} asks for {', '.join(unsupported) or 'non-causal attention'}; context-parallel attention "
                "supports plain causal attention within documents only."
            )
        layout = self.layout
        if layout is None:
            raise RuntimeError("Context-parallel attention ran before set_layout(shard.layout) was called.")
        expected = (layout.batch_size, layout.local_length)
        if (query.shape[0], query.shape[2]) != expected or key.shape[2] != query.shape[2]:
            raise ValueError(
                f"{name} got {query.shape[0]} row(s) of {query.shape[2]} queries and {key.shape[2]} keys, but the "
                f"layout set last is for {expected[0]} row(s) of {expected[1]} tokens on this rank: call "
                "set_layout(shard.layout) with every batch (and use no KV cache)."
            )
        if not self._positions_checked and kwargs.get("position_ids") is not None:
            self._check_positions(kwargs["position_ids"], layout)
        return layout

    def _check_positions(self, position_ids: Tensor, layout: ShardLayout) -> None:
        """Once per batch (one device sync): RoPE must rotate each token by its position in the row. Called
        without ``position_ids`` a model numbers the shard from 0, which is wrong on every rank but the first.
        The verdict is agreed over the group, so that every rank raises rather than some waiting for the others
        in the next exchange."""
        expected = layout.position_ids.to(position_ids.device)
        agreed = torch.tensor(int(torch.equal(position_ids.expand_as(expected), expected)), device=expected.device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=self.group)
        if not agreed.item():
            raise ValueError(
                f"The model was called with position_ids that are not the shard's (on this rank {position_ids[0, :6].tolist()}"
                f"... for tokens at {expected[0, :6].tolist()}... of their documents, or on another rank of the "
                "group): call it with position_ids=shard.batch['position_ids'] (global positions), never without them."
            )
        self._positions_checked = True


def _attention(module: nn.Module, *args: Any, **kwargs: Any) -> tuple[Tensor, None]:
    installation = _installed.get(module)
    if installation is None:
        raise RuntimeError(
            f"{type(module).__name__} uses a lit_memtrain context-parallel attention implementation but its model "
            "was not installed with lit_memtrain.parallel.context_parallel.install_attention(model, group, method)."
        )
    return installation(module, *args, **kwargs)


def _no_mask(*args: Any, attention_mask: Tensor | None = None, **kwargs: Any) -> None:
    if attention_mask is not None:
        raise ValueError(
            "The model was called with an attention_mask under context-parallel attention, which cannot honour it "
            "(it would cover the local shard only). Call the model without attention_mask, on batches from "
            "shard_batch (padding-free rows: documents are kept apart by their bounds)."
        )
    return None


for _name in ATTENTION_NAMES.values():
    AttentionInterface.register(_name, _attention)
    AttentionMaskInterface.register(_name, _no_mask)


def install_attention(
    model: nn.Module,
    group: dist.ProcessGroup,
    method: str = "ulysses",
    inner: str = SDPA_BY_DOCUMENT,
    ring_backend: str = "all_gather",
) -> ContextParallelAttention:
    """Make every attention layer of ``model`` attend over the whole row split across ``group``.

    Args:
        model: a transformers model (``PreTrainedModel``; its attention layers call ``AttentionInterface``).
        group: the context-parallel process group (the ranks that share one row).
        method: ``"ulysses"`` (all-to-all of heads) or ``"ring"`` (each rank's queries against the row's keys).
        inner: Ulysses' kernel over the whole row: ``"sdpa_by_document"``, ``"flash_attention_2"`` (CUDA,
            flash-attn) or ``"sdpa"`` (single-document rows).
        ring_backend: ``"all_gather"`` (all-gathered keys and values, document-aware, any device) or ``"torch"``
            (torch's ring kernels, CUDA, single-document rows; run each step inside
            :func:`~lit_memtrain.parallel.context_parallel.torch_ring_attention`).

    Returns:
        The installation: call ``set_layout`` with each batch's layout, ``uninstall`` to undo.

    Raises:
        ValueError: unknown method, inner kernel or backend; flash-attn missing for its kernel; head counts that ``method`` cannot split over the
            group (checked before any collective runs); a model already installed, or one whose attention cannot
            be switched.

    Example::

        attention = install_attention(model, cp_group, "ulysses")
        shard = shard_batch(batch, cp_rank, cp_size, "ulysses")
        attention.set_layout(shard.layout)
        hidden = model.model(input_ids=shard.batch["input_ids"], position_ids=shard.batch["position_ids"],
                             use_cache=False).last_hidden_state
    """
    check_context_parallel(model.config, dist.get_world_size(group), method)
    if inner not in INNER_ATTENTIONS:
        raise ValueError(f"inner must be one of {sorted(INNER_ATTENTIONS)}, got {inner!r}.")
    head_dim = attention_head_dim(model.config)
    if method == "ulysses" and inner == "flash_attention_2" and head_dim > FLASH_ATTN_MAX_HEAD_DIM:
        raise ValueError(
            f"inner='flash_attention_2' cannot run {type(model).__name__}: its attention heads have {head_dim} "
            f"dimensions and flash-attn's kernels stop at {FLASH_ATTN_MAX_HEAD_DIM}; use inner={SDPA_BY_DOCUMENT!r}."
        )
    if method == "ulysses":
        check_flash_attn(inner, "inner", SDPA_BY_DOCUMENT)
    if ring_backend not in RING_BACKENDS:
        raise ValueError(f"ring_backend must be one of {RING_BACKENDS}, got {ring_backend!r}.")
    if any(module in _installed for module in model.modules()):
        raise ValueError("This model already has context-parallel attention installed; uninstall it first.")
    previous = model.config._attn_implementation
    name = ATTENTION_NAMES[method]
    model.set_attn_implementation(name)
    if model.config._attn_implementation != name:  # transformers only warns for models it cannot switch
        raise ValueError(
            f"{type(model).__name__} kept attn_implementation={model.config._attn_implementation!r}: it does not "
            "call its attention through transformers' AttentionInterface, so context parallelism cannot split it."
        )
    installation = ContextParallelAttention(model, group, method, inner, ring_backend, previous)
    for module in model.modules():
        _installed[module] = installation
    return installation
