"""Collate preference pairs: every pair's chosen and rejected sequence, padded or flattened into one row.

Why both sides in one batch: the policy runs once per step on all ``2 B`` sequences (chosen ones first, then
rejected ones, as TRL orders them), and padding-free, those ``2 B`` documents share one row with no padding
between them: :class:`~lit_memtrain.datamodules.padding_free.PaddingFreeCollator` restarts the position ids
per document (and lists them in ``cu_seq_lens``), so a chosen and a rejected sequence never attend to each
other. ``sequence_ids`` says which of the ``2 B`` sequences each token belongs to, so the module sums the
completion log-probabilities of each sequence the same way for both layouts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from lit_memtrain.datamodules.collate import PaddedCollator
from lit_memtrain.datamodules.padding_free import PaddingFreeCollator
from lit_memtrain.datamodules.batch import IGNORE_INDEX, SCORED, scored_column

REFERENCE_COLUMNS = ("ref_chosen_logps", "ref_rejected_logps")
MARGIN_COLUMN = "margin"  # TRL's reward-model column: how far each pair's chosen reward should exceed its rejected


def _sequences(pairs: Sequence[Mapping[str, Any]]) -> list[dict[str, list[int]]]:
    """Prompt + chosen of every pair, then prompt + rejected of every pair; only completions are labelled."""
    sequences = []
    for side in ("chosen_ids", "rejected_ids"):
        for pair in pairs:
            prompt, completion = list(pair["prompt_ids"]), list(pair[side])
            sequences.append({"input_ids": prompt + completion, "labels": [IGNORE_INDEX] * len(prompt) + completion})
    return sequences


class PreferenceCollator:
    """Turn tokenized pairs (``prompt_ids``, ``chosen_ids``, ``rejected_ids``) into one batch of ``2 B`` sequences.

    Returns the keys of :class:`PaddingFreeCollator` (``padding_free=True``: one row) or of
    :class:`PaddedCollator` (one right-padded row per sequence), and:

    - ``labels``: the completion tokens, -100 on prompts and padding (unshifted, as for SFT).
    - ``sequence_ids``: ``LongTensor`` shaped like ``input_ids``, the sequence (0 .. 2B-1) of each token:
      chosen of pair ``i`` is ``i``, rejected is ``B + i``; padding is ``2 B``.
    - ``num_pairs``: ``B``.
    - ``ref_chosen_logps``, ``ref_rejected_logps``, ``margin``: ``FloatTensor [B]``, when the pairs carry them.
    - ``scored``: ``BoolTensor [B]``, when a pair is a validation repeat
      (:func:`~lit_memtrain.datamodules.batch.scored_column`).

    Example:
        >>> collate = PreferenceCollator(pad_token_id=0)
        >>> batch = collate([{"prompt_ids": [1, 2], "chosen_ids": [3], "rejected_ids": [4, 5]}])
        >>> batch["input_ids"].tolist(), batch["sequence_ids"].tolist()
        ([[1, 2, 3, 1, 2, 4, 5]], [[0, 0, 0, 1, 1, 1, 1]])
    """

    def __init__(self, pad_token_id: int, pad_to_multiple_of: int | None = None, padding_free: bool = True) -> None:
        self.padding_free = padding_free
        inner = PaddingFreeCollator if padding_free else PaddedCollator
        self.inner = inner(pad_token_id, pad_to_multiple_of)

    def __call__(self, pairs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        if len(pairs) == 0:
            raise ValueError("PreferenceCollator got an empty list of pairs.")
        batch = self.inner(_sequences(pairs))
        num_sequences = 2 * len(pairs)
        if self.padding_free:
            bounds = batch["cu_seq_lens_q"].long()
            segments = torch.arange(len(bounds) - 1).clamp(max=num_sequences)  # a padding segment comes last
            batch["sequence_ids"] = segments.repeat_interleave(bounds[1:] - bounds[:-1])[None]
        else:
            rows = torch.arange(num_sequences)[:, None].expand_as(batch["input_ids"])
            batch["sequence_ids"] = rows.masked_fill(batch["attention_mask"] == 0, num_sequences)
        batch["num_pairs"] = len(pairs)
        for name in (*REFERENCE_COLUMNS, MARGIN_COLUMN):
            if name in pairs[0]:
                batch[name] = torch.tensor([float(pair[name]) for pair in pairs], dtype=torch.float32)
        scored = scored_column(pairs)
        if scored is not None:
            batch[SCORED] = scored
        return batch
