"""What a batch holds between the datamodules and the training step: its keys, ``IGNORE_INDEX`` and the target shift.

Why one file: the collators write these keys and values, and the modules, the context-parallel sharding, the
callbacks and the planner read them; a fact stated twice (the ignored label, how targets line up with positions)
drifts. A batch is a dict of tensors:

- ``input_ids`` ``[B, L]`` and ``labels`` ``[B, L]`` (unshifted: ``labels[t]`` is token ``t`` itself, ``IGNORE_INDEX``
  where it is not trained);
- padded rows: ``attention_mask`` ``[B, L]``; padding-free rows (one flattened row of several documents):
  ``position_ids`` restarting at 0 per document, ``cu_seq_lens_q/k`` and ``max_length_q/k`` (flash-attn's varlen
  bounds), ``seq_lengths``, ``num_tokens`` (real tokens, the rest is padding), ``cu_seq_lens_on_host`` (the
  bounds again as a tuple of ints, which Lightning's transfer leaves on the host: :func:`host_document_starts`);
- ``shift_labels`` ``[B, L]`` (targets already aligned with each position) replaces ``labels`` on a sequence
  shard of a context-parallel group, shifted on the whole row before it was cut;
- counts for the loss and the throughput meter, never passed to the model (:data:`BATCH_ONLY_KEYS`):
  ``num_tokens``, ``seq_lengths``, ``attention_pairs`` (a sequence shard's share of its rows' attention pairs) and
  ``step_trainable_tokens`` (the trainable targets of the batch's whole optimizer step) and ``step_window`` (that
  step's micro-batches and the accumulation they were read ahead for), tagged by
  :mod:`lit_memtrain.objectives.step_tokens`; ``num_trainable_tokens``, which collators of 0.1 wrote, is kept
  from the model too; ``margin`` (``[pairs]``, TRL's reward-model column: how far a pair's chosen reward should
  exceed its rejected one), read by the reward loss only; ``scored`` (``[rows]`` bool: pairs, or prompts), in a
  validation batch that holds a repeated row which evens out the data-parallel ranks: which rows count in the
  metrics (:func:`scored_rows`; absent, every row counts).

:func:`model_inputs` is what the model's forward takes from a batch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "BATCH_ONLY_KEYS",
    "CU_SEQ_LENS_ON_HOST",
    "IGNORE_INDEX",
    "SCORED",
    "STEP_TRAINABLE_TOKENS",
    "STEP_WINDOW",
    "VARLEN_KEYS",
    "batch_targets",
    "host_document_starts",
    "is_padding_free",
    "mark_unscored",
    "model_inputs",
    "scored_column",
    "scored_rows",
    "shift_targets",
]

IGNORE_INDEX = -100  # a label the loss skips (prompt tokens, padding, each document's first token)
STEP_TRAINABLE_TOKENS = "step_trainable_tokens"
STEP_WINDOW = "step_window"
SCORED = "scored"
CU_SEQ_LENS_ON_HOST = "cu_seq_lens_on_host"
# The key that marks a dataset row as a validation repeat: a name no dataset column has (prompts keep every column).
_UNSCORED_MARK = "__lit_memtrain_unscored__"
BATCH_ONLY_KEYS = (
    "labels", "shift_labels", "num_trainable_tokens", "num_tokens", "seq_lengths", "attention_pairs",
    STEP_TRAINABLE_TOKENS, STEP_WINDOW, "margin", SCORED, CU_SEQ_LENS_ON_HOST,
)  # fmt: skip
VARLEN_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")  # a padding-free row's documents


def shift_targets(labels: Tensor) -> Tensor:
    """Targets aligned with each position: ``labels`` moved left by one, ``IGNORE_INDEX`` at the last position."""
    return F.pad(labels[..., 1:], (0, 1), value=IGNORE_INDEX)


def batch_targets(batch: dict[str, Any]) -> Tensor:
    """The batch's targets aligned with each position: ``shift_labels`` as given (a context-parallel shard), else
    ``labels`` shifted here."""
    return batch["shift_labels"] if "shift_labels" in batch else shift_targets(batch["labels"])


def is_padding_free(batch: dict[str, Any]) -> bool:
    """One row of several documents told apart by ``position_ids`` restarting at 0, without an attention mask."""
    return "position_ids" in batch and "attention_mask" not in batch


def model_inputs(batch: dict[str, Any], varlen: bool = False, cu_seq_lens_on_host: bool = False) -> dict[str, Any]:
    """The keyword arguments of the model's forward for ``batch``: every key but :data:`BATCH_ONLY_KEYS`, and
    ``use_cache=False`` (training needs no key-value cache).

    A padding-free row's document bounds (:data:`VARLEN_KEYS`) go only to an attention that reads them: all four
    as they are with ``varlen`` (flash-attn's varlen kernel), ``cu_seq_lens_q`` alone and on the host with
    ``cu_seq_lens_on_host`` (an attention that runs each document in turn reads the bounds once per step this way,
    not once per layer). Which one an attention implementation is, the caller says: data code knows no model.
    """
    inputs = {k: v for k, v in batch.items() if k not in BATCH_ONLY_KEYS and k not in VARLEN_KEYS}
    if is_padding_free(batch):
        if varlen:
            inputs.update({k: batch[k] for k in VARLEN_KEYS if k in batch})
        elif cu_seq_lens_on_host and "cu_seq_lens_q" in batch:
            inputs["cu_seq_lens_q"] = host_document_starts(batch)
    inputs["use_cache"] = False
    return inputs


def host_document_starts(batch: dict[str, Any]) -> Tensor:
    """A padding-free batch's ``cu_seq_lens_q`` as an int32 tensor on the host.

    Why: code that loops over documents on the host (the per-document attention, the attention-pair count) needs the
    bounds there, but Lightning moves every tensor of the batch to the device; reading them back (``.cpu()``) waits
    for all the work queued on the device, once a step. The collator's copy under :data:`CU_SEQ_LENS_ON_HOST` (a
    tuple of ints, which the transfer leaves alone) costs nothing; a batch without it is read back.
    """
    kept = batch.get(CU_SEQ_LENS_ON_HOST)
    if kept is None:
        return batch["cu_seq_lens_q"].cpu()
    # Shapes only (no read of the device): a batch changed after collation without its host copy would otherwise
    # run its attention over the old documents.
    rows = batch["input_ids"].shape[-1] if "input_ids" in batch else kept[-1]
    if len(kept) != batch["cu_seq_lens_q"].shape[0] or kept[-1] != rows:
        raise ValueError(
            f"The batch's {CU_SEQ_LENS_ON_HOST!r} ({len(kept)} bounds, the last {kept[-1]}) does not describe its "
            f"cu_seq_lens_q ({batch['cu_seq_lens_q'].shape[0]} bounds) and row of {rows} tokens: code that changes a "
            f"collated padding-free batch must update or drop {CU_SEQ_LENS_ON_HOST!r} too."
        )
    return torch.tensor(kept, dtype=torch.int32)


def mark_unscored(row: dict[str, Any]) -> dict[str, Any]:
    """``row`` as a repeat that evens out the data-parallel ranks in validation: a collator that reads the mark
    (:func:`scored_column`) gives its batch a :data:`SCORED` entry false for this row, which the metrics leave out."""
    return {**row, _UNSCORED_MARK: True}


def scored_column(rows: Sequence[Mapping[str, Any]]) -> Tensor | None:
    """A collator's :data:`SCORED` entry for ``rows``: ``[rows]`` bool, false where :func:`mark_unscored` marked a
    row; ``None`` when no row is marked (the batch then holds no entry: every row counts)."""
    if not any(_UNSCORED_MARK in row for row in rows):
        return None
    return torch.tensor([not row.get(_UNSCORED_MARK, False) for row in rows])


def scored_rows(batch: dict[str, Any], rows: int, device: torch.device | str | None = None) -> Tensor:
    """Which of a batch's ``rows`` (pairs, prompts) count in validation metrics, ``[rows]`` bool: its :data:`SCORED`
    entry, or every row when it has none."""
    scored = batch.get(SCORED)
    if scored is None:
        return torch.ones(rows, dtype=torch.bool, device=device)
    if scored.shape != (rows,):
        raise ValueError(
            f"The batch's {SCORED!r} entry has shape {tuple(scored.shape)}, expected one entry per row ({rows})."
        )
    return scored.to(device=device, dtype=torch.bool)
