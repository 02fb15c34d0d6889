"""Ring method for packed rows: gather every rank's keys and values, attend within each document.

Why not torch's ring: torch's ``context_parallel`` rotates K/V blocks through the flash / efficient / cuDNN SDPA
kernels with a plain causal mask; it takes no mask, so the documents of a packed row would attend to each other
(accelerate's context-parallel hook does exactly that, silently). It also does not run on CPU. This path keeps
documents apart on any device: each rank gathers the keys and values of the whole row (``kv_heads`` heads only,
so with grouped-query attention the gathered part is small next to the queries), then each of its query chunks
attends, one document at a time, to the keys of that document up to the chunk's last token, causally. The
causal mask is aligned to the bottom right (a query sees the keys up to its own global position), which SDPA
takes as a ``CausalBias`` that the CUDA kernels apply without building a mask (on CPU it is materialised, one
block at a time); where a chunk and its keys start together the plain ``is_causal`` kernel runs.

Memory: the gathered keys and values of the row per layer (``2 x L x kv_heads x head_dim``), which autograd
keeps for backward unless the layer is checkpointed; the queries, outputs and everything else stay ``L / cp``. Head-tail shards
(:func:`~lit_memtrain.parallel.context_parallel.sharding.rank_chunks`) give every rank the same amount of causal work.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.bias import CausalBias, CausalVariant

from lit_memtrain.parallel.context_parallel.exchange import gather_sequence
from lit_memtrain.parallel.context_parallel.sharding import ShardLayout

__all__ = ["AttentionBlock", "attention_blocks", "autocast_inputs", "gathered_kv_attention", "lower_right_causal"]


class AttentionBlock(NamedTuple):
    """Local queries ``[query_start, query_stop)`` attend to row keys ``[key_start, key_stop)`` of one document.

    ``mask`` is ``None`` where the block starts with its document (plain causal attention), else the
    lower-right causal bias. It is made here, once per batch, and not in the forward: ``CausalBias`` is a
    tensor subclass, which cannot be created under selective checkpointing's dispatch mode.
    """

    query_start: int
    query_stop: int
    key_start: int
    key_stop: int
    mask: CausalBias | None


def lower_right_causal(seq_len_q: int, seq_len_kv: int) -> CausalBias:
    """torch's lower-right ``CausalBias`` without the dense tensor its constructor allocates.

    ``causal_lower_right(q, kv)`` goes through ``torch.Tensor.__new__(variant, q, kv)``, which allocates an
    uninitialised ``[2, q, kv]`` fp32 CPU tensor that nothing reads: 40 GB for a 50k-token chunk against 100k keys,
    and an allocation failure at long lengths. SDPA reads only the variant and the two lengths, so the bias here
    is an empty tensor carrying them.
    """
    bias = torch.Tensor._make_subclass(CausalBias, torch.empty(0))
    bias.variant, bias.seq_len_q, bias.seq_len_kv = CausalVariant.LOWER_RIGHT, seq_len_q, seq_len_kv
    return bias


def attention_blocks(layout: ShardLayout) -> list[AttentionBlock]:
    """One block for every (local chunk, document) pair of this rank, in local order, covering the shard."""
    bounds = layout.cu_seq_lens.tolist()
    blocks, offset = [], 0
    for start, stop in layout.chunks:
        for first, last in zip(bounds[:-1], bounds[1:], strict=True):
            low, high = max(start, first), min(stop, last)
            if low < high:
                mask = None if low == first else lower_right_causal(high - low, high - first)
                blocks.append(AttentionBlock(offset + low - start, offset + high - start, first, high, mask))
        offset += stop - start
    return blocks


def autocast_inputs(query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Queries, keys and values in the dtype autocast computes attention in (the queries' without autocast).

    Under autocast, RMS-normed queries and keys come out in fp32 and values in bf16 (Qwen3's q/k norms); plain
    SDPA casts them itself, but the kernels called here (through attention-bias tensors or torch's ring) do not,
    and a cast before an exchange also halves what crosses the ranks.
    """
    device = query.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else query.dtype
    return query.to(dtype), key.to(dtype), value.to(dtype)


def gathered_kv_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    layout: ShardLayout,
    blocks: list[AttentionBlock],
    group: dist.ProcessGroup,
    scaling: float | None,
    dropout: float,
) -> Tensor:
    """Document-causal attention of this rank's queries over the whole row's keys and values.

    Args:
        query: ``[B, heads, local tokens, D]``; key, value: ``[B, kv_heads, local tokens, D]``.
        layout: the layout of the batch (from :func:`~lit_memtrain.parallel.context_parallel.shard_batch`).
        blocks: ``attention_blocks(layout)``, made outside the forward.
        group: the context-parallel process group.

    Returns:
        ``[B, local tokens, heads, D]``, as transformers' attention functions return it.
    """
    # The document masks are torch's attention-bias tensors, whose SDPA bypasses autocast's casting.
    query, key, value = autocast_inputs(query, key, value)
    order = layout.gathered_order()
    key, value = gather_sequence(key, group, order), gather_sequence(value, group, order)
    groups = query.shape[1] // key.shape[1]
    outputs = []
    for block in blocks:
        block_key = key[:, :, block.key_start : block.key_stop]
        block_value = value[:, :, block.key_start : block.key_stop]
        if block.mask is not None and groups > 1:  # the lower-right kernels take no grouped heads
            block_key = block_key.repeat_interleave(groups, dim=1)
            block_value = block_value.repeat_interleave(groups, dim=1)
        outputs.append(
            F.scaled_dot_product_attention(
                query[:, :, block.query_start : block.query_stop],
                block_key,
                block_value,
                attn_mask=block.mask,
                dropout_p=dropout,
                is_causal=block.mask is None,
                scale=scaling,
                enable_gqa=query.shape[1] != block_key.shape[1],
            )
        )
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous()
