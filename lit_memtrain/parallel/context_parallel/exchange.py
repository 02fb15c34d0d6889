"""The collectives of context parallelism, differentiable: all-to-all (Ulysses) and all-gather (ring).

Why these and not ``torch.distributed.nn.functional``: that module's ``all_gather`` returns wrong gradients on
gloo when the incoming gradient is not contiguous (seen on the CPU machine: errors of 3.0), which is exactly
what a permuted or sliced key/value tensor produces. The functional collectives
(``torch.distributed._functional_collectives``) give correct gradients on gloo and NCCL; every tensor handed
to them here is made contiguous with its sequence (all-gather) or head group (all-to-all) in dimension 0, the
layout their backward assumes.

Shapes follow transformers' attention functions: queries, keys and values are ``[batch, heads, tokens,
head_dim]``; attention outputs are ``[batch, tokens, heads, head_dim]``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as functional
from torch import Tensor

__all__ = ["gather_sequence", "heads_to_sequence", "sequence_to_heads"]

# torch 2.13 renamed the autograd all-gather; the machines we support run 2.11 to 2.13.
_all_gather_autograd = getattr(functional, "all_gather_single_autograd", None) or functional.all_gather_tensor_autograd


def sequence_to_heads(states: Tensor, group: dist.ProcessGroup) -> Tensor:
    """``[B, H, local tokens, D]`` on each rank -> ``[B, H / cp, cp * local tokens, D]``: rank ``j`` gets heads
    ``j * H / cp`` to ``(j + 1) * H / cp`` of every rank's tokens, in rank order (contiguous shards: row order)."""
    size = dist.get_world_size(group)
    batch, heads, tokens, head_dim = states.shape
    send = states.transpose(0, 1).reshape(size, heads // size, batch, tokens, head_dim).contiguous()
    received = functional.all_to_all_single_autograd(send, None, None, group)
    return received.permute(2, 1, 0, 3, 4).reshape(batch, heads // size, size * tokens, head_dim)


def heads_to_sequence(output: Tensor, group: dist.ProcessGroup) -> Tensor:
    """The inverse exchange for attention outputs: ``[B, cp * local tokens, H / cp, D]`` ->
    ``[B, local tokens, H, D]``, each rank getting all heads of its own tokens back."""
    size = dist.get_world_size(group)
    batch, tokens, heads, head_dim = output.shape
    send = output.reshape(batch, size, tokens // size, heads, head_dim).transpose(0, 1).contiguous()
    received = functional.all_to_all_single_autograd(send, None, None, group)
    return received.permute(1, 2, 0, 3, 4).reshape(batch, tokens // size, size * heads, head_dim)


def gather_sequence(states: Tensor, group: dist.ProcessGroup, order: list[tuple[int, int]]) -> Tensor:
    """``[B, H, local tokens, D]`` on each rank -> ``[B, H, all tokens, D]`` on every rank, in row order.

    ``order`` lists the slices of the rank-major concatenation that, put together, give the row in order
    (:meth:`~lit_memtrain.parallel.context_parallel.sharding.ShardLayout.gathered_order`). The backward sums each
    rank's gradient into the owner of the tokens (a reduce-scatter).
    """
    send = states.permute(2, 0, 1, 3).contiguous()
    gathered = _all_gather_autograd(send, 0, group)
    if len(order) > 1:
        gathered = torch.cat([gathered[start:stop] for start, stop in order])
    return gathered.permute(1, 2, 0, 3)

