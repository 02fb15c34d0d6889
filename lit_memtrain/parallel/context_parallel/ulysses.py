"""Ulysses: turn sequence shards into head shards around attention, so any kernel sees whole documents.

Why Ulysses first: after one all-to-all each rank holds every token of ``heads / cp`` heads, so the inner
attention is an ordinary single-device kernel over the whole row. Packed documents stay apart because the
inner kernel is given the document bounds of the whole row (from the
:class:`~lit_memtrain.parallel.context_parallel.sharding.ShardLayout`), never the mask transformers built from the local
shard (whose position ids, seen alone, describe the wrong documents). A second all-to-all gives each rank all
heads of its own tokens back. Exchange volume per layer: queries, keys, values and outputs once each, ``1 / cp``
of them leaving each rank.

Inner kernels:

- ``"sdpa_by_document"`` (default; any device): SDPA once per document, O(L) memory.
- ``"flash_attention_2"``: flash-attn's varlen kernel over the row's documents (CUDA, the ``flash-attn``
  package).
- ``"sdpa"``: one causal SDPA call over the row; for rows of a single document only (padding added by
  :func:`~lit_memtrain.parallel.context_parallel.shard_batch` sits at the end and cannot be seen by a real token).
  ``ContextParallelAttention.set_layout`` refuses other rows.

Grouped-query attention: with fewer key/value heads than ranks each key/value head is repeated ``cp /
kv_heads`` times before the exchange (``repeat_interleave``: replica ``j`` lands on rank ``j``, the rank whose
query heads belong to that key/value head); backward sums the replicas' gradients.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lit_memtrain.techniques.attention import SDPA_BY_DOCUMENT, sdpa_by_document
from lit_memtrain.parallel.context_parallel.exchange import heads_to_sequence, sequence_to_heads
from lit_memtrain.parallel.context_parallel.sharding import ShardLayout

__all__ = ["INNER_ATTENTIONS", "ulysses_attention"]

InnerAttention = Callable[[nn.Module, Tensor, Tensor, Tensor, ShardLayout, "float | None", float], Tensor]


def _sdpa_by_document(
    module: nn.Module, query: Tensor, key: Tensor, value: Tensor, layout: ShardLayout, scaling: float | None,
    dropout: float,
) -> Tensor:  # fmt: skip
    bounds = layout.cu_seq_lens if layout.batch_size == 1 else None  # several rows: one document each
    output, _ = sdpa_by_document(
        module, query, key, value, None, scaling=scaling, dropout=dropout, is_causal=True, cu_seq_lens_q=bounds
    )
    return output


def _sdpa(
    module: nn.Module, query: Tensor, key: Tensor, value: Tensor, layout: ShardLayout, scaling: float | None,
    dropout: float,
) -> Tensor:  # fmt: skip
    # One causal call per batch (no document bounds: set_layout refuses rows of several segments). Grouped heads
    # are matched by the shapes the exchange delivers, never by the module's ``num_key_value_groups``: with fewer
    # key/value heads than ranks each rank holds one replicated key/value head for ``heads / cp`` query heads, and
    # transformers' SDPA, which repeats keys by the module's ratio where its GQA kernels stop (head_dim > 256),
    # would then attend with mismatched heads.
    output, _ = sdpa_by_document(module, query, key, value, None, scaling=scaling, dropout=dropout, is_causal=True)
    return output


def _flash_varlen(
    module: nn.Module, query: Tensor, key: Tensor, value: Tensor, layout: ShardLayout, scaling: float | None,
    dropout: float,
) -> Tensor:  # fmt: skip
    from flash_attn import flash_attn_varlen_func  # install_attention checked that it is installed

    batch, heads, length, head_dim = query.shape
    # Every row has the same segments: offset them per row to describe the batch as one flat sequence.
    rows = torch.arange(batch, dtype=torch.int32)[:, None] * length
    starts = (layout.cu_seq_lens[:-1][None] + rows).flatten()
    bounds = torch.cat([starts, torch.tensor([batch * length], dtype=torch.int32)]).to(query.device)

    def flat(states: Tensor) -> Tensor:
        return states.transpose(1, 2).reshape(batch * length, states.shape[1], head_dim)

    output = flash_attn_varlen_func(
        flat(query), flat(key), flat(value), bounds, bounds, layout.max_segment_length, layout.max_segment_length,
        dropout_p=dropout, softmax_scale=scaling, causal=True,
    )  # fmt: skip
    return output.reshape(batch, length, heads, head_dim)


INNER_ATTENTIONS: dict[str, InnerAttention] = {
    SDPA_BY_DOCUMENT: _sdpa_by_document,
    "sdpa": _sdpa,
    "flash_attention_2": _flash_varlen,
}


def ulysses_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    layout: ShardLayout,
    group: dist.ProcessGroup,
    inner: str,
    scaling: float | None,
    dropout: float,
) -> Tensor:
    """Attention of this rank's tokens with the whole row, heads exchanged around ``inner``.

    Args:
        query: ``[B, heads, local tokens, D]``; key, value: ``[B, kv_heads, local tokens, D]``.
        layout: the batch's layout (contiguous shards).
        group: the context-parallel process group.
        inner: a key of :data:`INNER_ATTENTIONS`.

    Returns:
        ``[B, local tokens, heads, D]``, as transformers' attention functions return it.
    """
    size = dist.get_world_size(group)
    replicas = size // key.shape[1]
    if replicas > 1:
        key, value = key.repeat_interleave(replicas, dim=1), value.repeat_interleave(replicas, dim=1)
    query, key, value = (sequence_to_heads(states, group) for states in (query, key, value))
    output = INNER_ATTENTIONS[inner](module, query, key, value, layout, scaling, dropout)
    return heads_to_sequence(output, group)
