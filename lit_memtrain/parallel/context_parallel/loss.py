"""The loss of a sequence shard, normalised so that the ranks together give one process's loss.

Why: the loss of a step is the mean over its trainable targets. Split over ranks, each rank has the sum of its
own token losses; dividing each by the count of trainable targets over *all* ranks makes the ranks' losses
(and gradients) add up to exactly the mean one process computes on the whole row. Dividing by the local count
instead weighs a shard of few targets as much as a full one; counting on the unsharded row on every rank
counts each target ``cp`` times.

The count is taken on the shard's ``shift_labels`` (already shifted on the whole row by
:func:`~lit_memtrain.parallel.context_parallel.shard_batch`) and summed with one all-reduce; the sum of token losses is
:func:`lit_memtrain.techniques.loss.chunked_cross_entropy`, so the ``[tokens, vocab]`` logits of the shard never exist.
Parameter gradients must then be *summed* over the ranks that saw the row (FSDP2 and DDP average: multiply by
the number of ranks averaged over, as ``CausalLMModule`` already does for data parallelism).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from lit_memtrain.techniques.loss import chunked_cross_entropy
from lit_memtrain.datamodules.batch import IGNORE_INDEX

__all__ = ["global_target_count", "shard_loss"]


def global_target_count(shift_labels: Tensor, group: dist.ProcessGroup | None = None) -> Tensor:
    """Trainable targets of this shard summed over ``group`` (all ranks when ``None``); a 0-d int64 tensor."""
    count = (shift_labels != IGNORE_INDEX).sum().to(torch.int64)
    dist.all_reduce(count, group=group)
    return count


def shard_loss(
    hidden: Tensor,
    weight: Tensor,
    shift_labels: Tensor,
    num_items: int | Tensor,
    chunk_size: int = 1024,
    softcap: float | None = None,
    bias: Tensor | None = None,
) -> Tensor:
    """This shard's token losses summed and divided by ``num_items``, the trainable targets of all ranks.

    Args:
        hidden: ``[B, local tokens, H]`` final hidden states of the shard (after the final norm).
        weight: ``[V, H]`` LM-head weight.
        shift_labels: ``[B, local tokens]``, the shard's targets as ``shard_batch`` returns them (not shifted
            again here).
        num_items: trainable targets of the step over every rank (:func:`global_target_count`).
        chunk_size, softcap, bias: as for :func:`~lit_memtrain.techniques.loss.chunked_cross_entropy`.

    Example::

        count = global_target_count(shard.batch["shift_labels"])
        loss = shard_loss(hidden, model.lm_head.weight, shard.batch["shift_labels"], count)
        loss.backward()  # then sum the gradients over the ranks
    """
    if hidden.shape[:2] != shift_labels.shape:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} and shift_labels {tuple(shift_labels.shape)} must share [batch, tokens]."
        )
    return chunked_cross_entropy(
        hidden.flatten(0, 1), weight, shift_labels.flatten(), num_items, chunk_size, softcap, bias
    )
