"""What a batch holds between the datamodules and the training step: its keys, ``IGNORE_INDEX`` and the target shift.

Why one file: the collators write these keys and values, and the modules, the context-parallel sharding, the
callbacks and the planner read them; a fact stated twice (the ignored label, how targets line up with positions)
drifts. A batch is a dict of tensors:

- ``input_ids`` ``[B, L]`` and ``labels`` ``[B, L]`` (unshifted: ``labels[t]`` is token ``t`` itself, ``IGNORE_INDEX``
  where it is not trained);
- padded rows: ``attention_mask`` ``[B, L]``; padding-free rows (one flattened row of several documents):
  ``position_ids`` restarting at 0 per document, ``cu_seq_lens_q/k`` and ``max_length_q/k`` (flash-attn's varlen
  bounds), ``seq_lengths``, ``num_tokens`` (real tokens, the rest is padding);
- ``shift_labels`` ``[B, L]`` (targets already aligned with each position) replaces ``labels`` on a sequence
  shard of a context-parallel group, shifted on the whole row before it was cut.
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from torch import Tensor

__all__ = ["IGNORE_INDEX", "batch_targets", "shift_targets"]

IGNORE_INDEX = -100  # a label the loss skips (prompt tokens, padding, each document's first token)


def shift_targets(labels: Tensor) -> Tensor:
    """Targets aligned with each position: ``labels`` moved left by one, ``IGNORE_INDEX`` at the last position."""
    return F.pad(labels[..., 1:], (0, 1), value=IGNORE_INDEX)


def batch_targets(batch: dict[str, Any]) -> Tensor:
    """The batch's targets aligned with each position: ``shift_labels`` as given (a context-parallel shard), else
    ``labels`` shifted here."""
    return batch["shift_labels"] if "shift_labels" in batch else shift_targets(batch["labels"])
