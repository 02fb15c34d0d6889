"""CUDA glue for torch's ring attention (``torch.distributed.tensor.experimental.context_parallel``).

Why use it: on CUDA it rotates key/value blocks between ranks through the flash / efficient / cuDNN SDPA kernels
and overlaps the exchange with compute, so no rank ever holds the row's keys and values. Why it is limited:

- It takes no mask (``attn_bias is not supported yet``): a causal mask over the whole row is all it can apply,
  so it serves rows of a single document only. Packed rows go through the document-aware all-gather path
  (``ring_backend="all_gather"``) or Ulysses; :func:`torch_ring_attention` refuses them rather than letting
  documents attend to each other.
- It runs on CUDA only (no sharding strategy for the CPU flash op).
- It patches ``torch.nn.functional.scaled_dot_product_attention`` only while its context is open, and backward
  calls the ring kernels again: the context must stay open from forward through backward (a Lightning strategy:
  from ``on_train_batch_start`` to ``on_train_batch_end``). The attention installed with
  ``ring_backend="torch"`` raises when it runs outside the context, instead of silently attending within the
  local shard.
- It shards its buffers with its own head-tail load balancer, and turns load balancing off silently when the
  length is not a multiple of ``2 * cp``. :func:`torch_ring_attention` hands torch a probe (the token indices
  of the row) and checks that torch's shard is the one :func:`~lit_memtrain.parallel.context_parallel.shard_batch`
  gave this rank, so the two can never disagree unnoticed (a change of torch's order raises here).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor

from lit_memtrain.parallel.context_parallel.ring_attention import autocast_inputs
from lit_memtrain.parallel.context_parallel.sharding import ShardLayout

__all__ = ["active_torch_ring_layout", "torch_ring_attention", "torch_ring_sdpa"]

_active: list[ShardLayout] = []


def active_torch_ring_layout() -> ShardLayout | None:
    """The layout of the open :func:`torch_ring_attention` context, or ``None`` outside one."""
    return _active[-1] if _active else None


@contextlib.contextmanager
def torch_ring_attention(mesh: object, layout: ShardLayout) -> Iterator[None]:
    """Run SDPA calls as torch's ring attention over ``mesh`` (1-D, the context-parallel ranks) for one batch.

    Args:
        mesh: a CUDA ``DeviceMesh`` of the context-parallel group.
        layout: the layout :func:`~lit_memtrain.parallel.context_parallel.shard_batch` returned for the batch
            (``method="ring"``): the model's inputs are already this rank's head-tail shard.

    Raises:
        ValueError: the batch is not a ring shard, or its row holds several documents (torch's ring takes no
            mask), or the mesh is not on CUDA.
        RuntimeError: torch shards the row differently from ``shard_batch``.

    Example::

        shard = shard_batch(batch, cp_rank, cp_size, "ring")
        attention.set_layout(shard.layout)  # installed with ring_backend="torch"
        with torch_ring_attention(cp_mesh, shard.layout):
            loss = loss_fn(model, shard.batch)
            loss.backward()
    """
    from torch.distributed.tensor.experimental import context_parallel

    if layout.method != "ring":
        raise ValueError(f"torch's ring attention needs a batch sharded with method='ring', got {layout.method!r}.")
    if layout.num_documents > 1:
        raise ValueError(
            f"torch's ring attention takes no mask, and this row holds {layout.num_documents} segments (packed "
            "documents or a collator's padding): they would attend to each other. Use method='ulysses', or "
            "method='ring' with ring_backend='all_gather' (document-aware)."
        )
    if getattr(mesh, "device_type", None) != "cuda":
        raise ValueError(
            f"torch's ring attention runs on CUDA only; got a {getattr(mesh, 'device_type', mesh)!r} mesh. Use "
            "ring_backend='all_gather' or method='ulysses'."
        )
    probe = torch.arange(layout.length, device="cuda")
    with context_parallel(mesh, buffers=[probe], buffer_seq_dims=[0], no_restore_buffers={probe}):
        expected = torch.cat([torch.arange(start, stop) for start, stop in layout.chunks])
        if not torch.equal(probe.cpu(), expected):
            raise RuntimeError(
                f"torch's context_parallel gives rank {layout.cp_rank} tokens {probe[:4].tolist()}..., but shard_batch "
                f"gave it {expected[:4].tolist()}...: the two head-tail orders differ in this torch version, so "
                "attention would pair the wrong tokens. Use ring_backend='all_gather' or method='ulysses'."
            )
        _active.append(layout)
        try:
            yield
        finally:
            _active.pop()


def torch_ring_sdpa(query: Tensor, key: Tensor, value: Tensor, layout: ShardLayout, scaling: float | None,
                    dropout: float) -> Tensor:  # fmt: skip
    """Causal SDPA over the row through torch's ring kernels; ``[B, local tokens, heads, D]``.

    Key/value heads are repeated to the query heads first: the ring kernels take no grouped heads.
    """
    if active_torch_ring_layout() is not layout:
        raise RuntimeError(
            "Attention installed with ring_backend='torch' ran outside torch_ring_attention(mesh, layout) for this "
            "batch's layout: it would attend within the local shard only. Keep the context open from the forward "
            "through the backward (checkpointed layers run attention again in backward)."
        )
    query, key, value = autocast_inputs(query, key, value)
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    # Looked up at call time: torch's context replaces the function on the module while it is open.
    output = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, dropout_p=dropout, is_causal=True, scale=scaling
    )
    return output.transpose(1, 2).contiguous()
