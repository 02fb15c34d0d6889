"""Padded batches: right-pad ``input_ids`` and ``labels`` to the longest example (or a multiple of N)."""

from __future__ import annotations

from typing import Any

import torch

from lit_memtrain.datamodules.batch import IGNORE_INDEX


def round_up(value: int, multiple: int | None) -> int:
    """``value`` rounded up to a multiple of ``multiple`` (unchanged when ``multiple`` is None)."""
    if not multiple:
        return value
    return -(-value // multiple) * multiple


class PaddedCollator:
    """Collate tokenized examples into right-padded tensors with an attention mask.

    Padding positions get ``pad_token_id`` as input, -100 as label and 0 in ``attention_mask``, so they are
    neither attended to nor trained on.

    Example:
        >>> collate = PaddedCollator(pad_token_id=0, pad_to_multiple_of=8)
        >>> batch = collate([{"input_ids": [5, 6, 7], "labels": [5, 6, 7]}])
        >>> batch["input_ids"].shape
        torch.Size([1, 8])
    """

    def __init__(self, pad_token_id: int, pad_to_multiple_of: int | None = None) -> None:
        if pad_to_multiple_of is not None and pad_to_multiple_of < 1:
            raise ValueError(f"pad_to_multiple_of must be a positive integer or None, got {pad_to_multiple_of}.")
        self.pad_token_id = pad_token_id
        self.pad_to_multiple_of = pad_to_multiple_of

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        width = round_up(max(len(e["input_ids"]) for e in examples), self.pad_to_multiple_of)
        input_ids = torch.full((len(examples), width), self.pad_token_id, dtype=torch.long)
        labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
        attention_mask = torch.zeros((len(examples), width), dtype=torch.long)
        for row, example in enumerate(examples):
            n = len(example["input_ids"])
            input_ids[row, :n] = torch.as_tensor(example["input_ids"])
            labels[row, :n] = torch.as_tensor(example["labels"])
            attention_mask[row, :n] = 1
        return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}
