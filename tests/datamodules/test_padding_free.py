"""PaddingFreeCollator: every output checked value by value on small hand-written batches."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset

from lit_memtrain.datamodules.packing import pack_dataset
from lit_memtrain.datamodules.padding_free import PaddingFreeCollator


def assert_batch(batch: dict, input_ids, labels, position_ids, cu_seq_lens, max_length, trainable, real):
    assert batch["input_ids"].tolist() == [input_ids]
    assert batch["labels"].tolist() == [labels]
    assert batch["position_ids"].tolist() == [position_ids]
    for key in ("cu_seq_lens_q", "cu_seq_lens_k"):
        assert batch[key].dtype == torch.int32
        assert batch[key].tolist() == cu_seq_lens
    assert batch["max_length_q"] == batch["max_length_k"] == max_length
    assert type(batch["max_length_q"]) is int
    assert int((batch["labels"] != -100).sum()) == trainable
    assert batch["num_tokens"] == real
    assert batch["input_ids"].dtype == batch["labels"].dtype == batch["position_ids"].dtype == torch.long


def test_unpacked_examples_become_one_row_of_documents() -> None:
    batch = PaddingFreeCollator()([{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}])
    assert_batch(
        batch,
        input_ids=[1, 2, 3, 4, 5],
        labels=[-100, 2, 3, -100, 5],
        position_ids=[0, 1, 2, 0, 1],
        cu_seq_lens=[0, 3, 5],
        max_length=3,
        trainable=3,
        real=5,
    )


def test_packed_rows_use_seq_lengths_and_keep_given_labels() -> None:
    examples = [
        {"input_ids": [10, 11, 12, 13], "labels": [-100, 11, -100, 13], "seq_lengths": [3, 1]},
        {"input_ids": [20, 21], "labels": [20, 21]},
    ]
    assert_batch(
        PaddingFreeCollator()(examples),
        input_ids=[10, 11, 12, 13, 20, 21],
        labels=[-100, 11, -100, -100, -100, 21],
        position_ids=[0, 1, 2, 0, 0, 1],
        cu_seq_lens=[0, 3, 4, 6],
        max_length=3,
        trainable=2,
        real=6,
    )


def test_padding_is_a_separate_untrained_segment() -> None:
    collator = PaddingFreeCollator(pad_token_id=99, pad_to_multiple_of=8)
    assert_batch(
        collator([{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}]),
        input_ids=[1, 2, 3, 4, 5, 99, 99, 99],
        labels=[-100, 2, 3, -100, 5, -100, -100, -100],
        position_ids=[0, 1, 2, 0, 1, 0, 1, 2],
        cu_seq_lens=[0, 3, 5, 8],
        max_length=3,
        trainable=3,
        real=5,
    )
    assert_batch(
        collator([{"input_ids": [7]}, {"input_ids": [8]}]),
        input_ids=[7, 8, 99, 99, 99, 99, 99, 99],
        labels=[-100, -100, -100, -100, -100, -100, -100, -100],
        position_ids=[0, 0, 0, 1, 2, 3, 4, 5],
        cu_seq_lens=[0, 1, 2, 8],
        max_length=6,
        trainable=0,
        real=2,
    )
    assert_batch(
        PaddingFreeCollator(pad_to_multiple_of=4)([{"input_ids": [1, 2, 3, 4]}]),
        input_ids=[1, 2, 3, 4],
        labels=[-100, 2, 3, 4],
        position_ids=[0, 1, 2, 3],
        cu_seq_lens=[0, 4],
        max_length=4,
        trainable=3,
        real=4,
    )


def test_tensors_and_empty_documents() -> None:
    examples = [
        {"input_ids": torch.tensor([5, 6, 7]), "seq_lengths": torch.tensor([0, 2, 1])},
        {"input_ids": torch.tensor([], dtype=torch.long)},
    ]
    assert_batch(
        PaddingFreeCollator()(examples),
        input_ids=[5, 6, 7],
        labels=[-100, 6, -100],
        position_ids=[0, 1, 0],
        cu_seq_lens=[0, 2, 3],
        max_length=2,
        trainable=1,
        real=3,
    )


def test_collates_rows_of_a_packed_dataset() -> None:
    source = Dataset.from_dict({"input_ids": [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10], [11]]})
    packed = pack_dataset(source, 4, "bfd").with_format("torch")
    batch = PaddingFreeCollator()([packed[0], packed[1], packed[2]])
    assert_batch(
        batch,
        input_ids=[1, 2, 3, 4, 8, 9, 10, 11, 6, 7],
        labels=[-100, 2, 3, 4, -100, 9, 10, -100, -100, 7],
        position_ids=[0, 1, 2, 3, 0, 1, 2, 0, 0, 1],
        cu_seq_lens=[0, 4, 7, 8, 10],
        max_length=4,
        trainable=6,
        real=10,
    )


def test_errors_are_clear() -> None:
    with pytest.raises(ValueError, match="pad_token_id must be a non-negative integer"):
        PaddingFreeCollator(pad_token_id=-1)
    with pytest.raises(ValueError, match="pad_to_multiple_of must be None or an integer >= 1"):
        PaddingFreeCollator(pad_to_multiple_of=0)
    collator = PaddingFreeCollator()
    with pytest.raises(ValueError, match="empty list of examples"):
        collator([])
    with pytest.raises(ValueError, match="no tokens"):
        collator([{"input_ids": []}])
    with pytest.raises(ValueError, match="Example 1 has 2 input_ids but 1 labels"):
        collator([{"input_ids": [1]}, {"input_ids": [1, 2], "labels": [3]}])
    expected = r"Example 0: seq_lengths \[2, 2\] must be >= 0 and add up to its 3 input_ids \(they add up to 4\)"
    with pytest.raises(ValueError, match=expected):
        collator([{"input_ids": [1, 2, 3], "seq_lengths": [2, 2]}])
    with pytest.raises(ValueError, match=r"Example 0: seq_lengths \[-1, 4\] must be >= 0"):
        collator([{"input_ids": [1, 2, 3], "seq_lengths": [-1, 4]}])


def test_the_host_copy_of_the_bounds_is_the_collated_one_and_a_changed_batch_is_refused():
    from lit_memtrain.datamodules.batch import CU_SEQ_LENS_ON_HOST, host_document_starts

    batch = PaddingFreeCollator(pad_to_multiple_of=8)(
        [{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}, {"input_ids": [4, 5], "labels": [4, 5]}]
    )
    assert batch[CU_SEQ_LENS_ON_HOST] == (0, 3, 5, 8)  # the padding is a segment of its own
    assert torch.equal(host_document_starts(batch), batch["cu_seq_lens_q"])
    assert torch.equal(host_document_starts({k: v for k, v in batch.items() if k != CU_SEQ_LENS_ON_HOST}),
                       batch["cu_seq_lens_q"])  # fmt: skip
    cut = dict(batch, input_ids=batch["input_ids"][:, :5], cu_seq_lens_q=batch["cu_seq_lens_q"][:3])
    with pytest.raises(ValueError, match=r"'cu_seq_lens_on_host' \(4 bounds, the last 8\) does not describe its "
                                         r"cu_seq_lens_q \(3 bounds\) and row of 5 tokens: code that changes"):
        host_document_starts(cut)
