"""Collate a batch into one flat row of documents, with no padding between them.

Why: a padded batch spends compute and activation memory on pad tokens. Flattening the batch into
a single row and restarting ``position_ids`` at 0 for every document lets the attention kernel keep
documents apart without any padding: flash-attn varlen reads ``cu_seq_lens_q/k`` and
``max_length_q/k``, and transformers' eager / sdpa / flex_attention paths detect the restarts in
``position_ids`` -- but only when the model is called with ``attention_mask=None`` and no KV cache,
which is how ``CausalLMModule`` calls it. The label of every document's first token is -100, so
after the module shifts labels left by one, no document is trained to predict the next one's first
token.

``pad_to_multiple_of`` (for kernels or compilers that like round shapes) appends the padding as one
more segment with its own positions starting at 0 and labels -100: no real document attends to it
and it is never trained on. It is listed in ``cu_seq_lens`` like any other segment.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from lit_memtrain.datamodules.batch import CU_SEQ_LENS_ON_HOST, IGNORE_INDEX


class PaddingFreeCollator:
    """Turn a list of examples into one flattened row of documents.

    Each example needs ``input_ids``; ``labels`` (same length) are used when present, else the
    labels are the input ids. An example with ``seq_lengths`` (a packed row from
    :func:`lit_memtrain.datamodules.packing.pack_dataset`) holds several documents of those
    lengths; one without it is a single document. Empty documents are skipped.

    Returns a dict with:

    - ``input_ids``: ``LongTensor [1, T]``.
    - ``labels``: ``LongTensor [1, T]``, -100 at each document's first token and on padding.
    - ``position_ids``: ``LongTensor [1, T]``, restarting at 0 for each document (and the padding).
    - ``cu_seq_lens_q``, ``cu_seq_lens_k``: ``IntTensor [S + 1]``, the start of each of the ``S``
      segments (documents, then padding if any) and ``T`` last.
    - ``max_length_q``, ``max_length_k``: ``int``, the longest segment (computed on CPU, so the
      varlen kernel needs no device-to-host sync).
    - ``num_tokens``: ``int``, the real tokens, padding excluded (for throughput metrics).
    - ``cu_seq_lens_on_host``: ``cu_seq_lens_q`` as a tuple of ints, which stays on the host when the batch moves
      to the device (:func:`~lit_memtrain.datamodules.batch.host_document_starts`: no read-back each step).

    Args:
        pad_token_id: token id written into the padding segment.
        pad_to_multiple_of: if set, pad ``T`` up to a multiple of this.

    Example::

        collator = PaddingFreeCollator(pad_token_id=0, pad_to_multiple_of=8)
        loader = DataLoader(pack_dataset(dataset, 4096), batch_size=2, collate_fn=collator)
    """

    def __init__(self, pad_token_id: int = 0, pad_to_multiple_of: int | None = None) -> None:
        if isinstance(pad_token_id, bool) or not isinstance(pad_token_id, int) or pad_token_id < 0:
            raise ValueError(
                f"pad_token_id must be a non-negative integer token id, got {pad_token_id!r}; "
                "use tokenizer.pad_token_id (or eos_token_id when the tokenizer has no pad token)."
            )
        if pad_to_multiple_of is not None and (
            isinstance(pad_to_multiple_of, bool)
            or not isinstance(pad_to_multiple_of, int)
            or pad_to_multiple_of < 1
        ):
            raise ValueError(
                f"pad_to_multiple_of must be None or an integer >= 1, got {pad_to_multiple_of!r}."
            )
        self.pad_token_id = pad_token_id
        self.pad_to_multiple_of = pad_to_multiple_of

    def __call__(self, examples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        if len(examples) == 0:
            raise ValueError("PaddingFreeCollator got an empty list of examples.")
        input_ids, labels, document_lengths = [], [], []
        for index, example in enumerate(examples):
            ids = _as_int_array(example["input_ids"])
            example_labels = _as_int_array(example.get("labels", ids))
            if len(example_labels) != len(ids):
                raise ValueError(
                    f"Example {index} has {len(ids)} input_ids but {len(example_labels)} labels."
                )
            lengths = _as_int_array(example.get("seq_lengths", [len(ids)]))
            if int(np.sum(lengths)) != len(ids) or (lengths < 0).any():
                raise ValueError(
                    f"Example {index}: seq_lengths {list(map(int, lengths))} must be >= 0 and add "
                    f"up to its {len(ids)} input_ids (they add up to {int(np.sum(lengths))})."
                )
            input_ids.append(ids)
            labels.append(example_labels)
            document_lengths.append(lengths)
        segment_lengths = np.concatenate(document_lengths).astype(np.int64)
        segment_lengths = segment_lengths[segment_lengths > 0]
        num_tokens = int(segment_lengths.sum())
        if num_tokens == 0:
            raise ValueError("PaddingFreeCollator got a batch with no tokens.")
        padding = self._padding(num_tokens)
        flat_ids = np.concatenate([*input_ids, np.full(padding, self.pad_token_id)])
        flat_labels = np.concatenate([*labels, np.full(padding, IGNORE_INDEX)])
        if padding:
            segment_lengths = np.append(segment_lengths, padding)
        cu_seq_lens = np.concatenate(([0], np.cumsum(segment_lengths)))
        position_ids = np.arange(len(flat_ids)) - np.repeat(cu_seq_lens[:-1], segment_lengths)
        flat_labels[cu_seq_lens[:-1]] = IGNORE_INDEX
        cu_seq_lens_tensor = torch.from_numpy(cu_seq_lens.astype(np.int32))
        max_length = int(segment_lengths.max())
        return {
            "input_ids": torch.from_numpy(flat_ids.astype(np.int64))[None],
            "labels": torch.from_numpy(flat_labels.astype(np.int64))[None],
            "position_ids": torch.from_numpy(position_ids.astype(np.int64))[None],
            "cu_seq_lens_q": cu_seq_lens_tensor,
            "cu_seq_lens_k": cu_seq_lens_tensor.clone(),
            "max_length_q": max_length,
            "max_length_k": max_length,
            "num_tokens": num_tokens,
            CU_SEQ_LENS_ON_HOST: tuple(cu_seq_lens.tolist()),
        }

    def _padding(self, num_tokens: int) -> int:
        if self.pad_to_multiple_of is None:
            return 0
        return -num_tokens % self.pad_to_multiple_of


def _as_int_array(values: Any) -> np.ndarray:
    if isinstance(values, torch.Tensor):
        return values.detach().cpu().numpy().astype(np.int64, copy=False).reshape(-1)
    return np.asarray(values, dtype=np.int64).reshape(-1)
