"""Sharding a batch along the sequence: targets, padding, order, counts and refusals (one process)."""

from __future__ import annotations

import pytest
import torch

from lit_memtrain.parallel.context_parallel import padded_length, shard_batch
from lit_memtrain.parallel.context_parallel.ring_attention import attention_blocks
from lit_memtrain.datamodules.padding_free import PaddingFreeCollator


def packed_batch(lengths: tuple[int, ...], pad_to_multiple_of: int | None = None) -> dict:
    examples = [{"input_ids": torch.arange(100 * (i + 1), 100 * (i + 1) + n)} for i, n in enumerate(lengths)]
    return PaddingFreeCollator(pad_token_id=0, pad_to_multiple_of=pad_to_multiple_of)(examples)


def global_positions(layout) -> list[int]:
    return [index for start, stop in layout.chunks for index in range(start, stop)]


@pytest.mark.parametrize("method", ["ulysses", "ring"])
@pytest.mark.parametrize("cp_size", [2, 3, 4])
def test_every_target_lands_once_next_to_its_own_token(method: str, cp_size: int) -> None:
    batch = packed_batch((5, 9, 4))  # 18 tokens: ids 100.., 200.., 300..
    row_ids = batch["input_ids"][0].tolist()
    row_targets = batch["labels"][0, 1:].tolist() + [-100]  # shifted on the whole row
    seen: dict[int, tuple[int, int]] = {}
    for rank in range(cp_size):
        shard = shard_batch(batch, rank, cp_size, method)
        ids, targets = shard.batch["input_ids"][0].tolist(), shard.batch["shift_labels"][0].tolist()
        for index, token, target in zip(global_positions(shard.layout), ids, targets, strict=True):
            assert index not in seen
            seen[index] = (token, target)
    length = padded_length(18, cp_size, method)
    assert sorted(seen) == list(range(length))
    assert [seen[i] for i in range(18)] == list(zip(row_ids, row_targets, strict=True))
    assert all(seen[i] == (0, -100) for i in range(18, length))  # padding: never trained
    # the last token of each document predicts nothing (the next document's first label is -100)
    assert [seen[i][1] for i in (4, 13, 17)] == [-100, -100, -100]


def test_ring_pads_to_twice_cp_and_keeps_positions_and_bounds_global() -> None:
    batch = packed_batch((6, 4))  # 10 tokens -> 12 for ring at cp 2 (chunks of 3)
    shard = shard_batch(batch, 1, 2, "ring")
    layout = shard.layout
    assert (layout.length, layout.padding, layout.num_documents) == (12, 2, 2)
    assert layout.chunks == ((3, 6), (6, 9))  # chunk 1 and chunk 2 * 2 - 1 - 1 = 2
    assert layout.cu_seq_lens.tolist() == [0, 6, 10, 12]  # the padding is a segment of its own
    assert shard.batch["position_ids"].tolist() == [[3, 4, 5, 0, 1, 2]]  # the row's own positions
    rank0 = shard_batch(batch, 0, 2, "ring")
    assert rank0.layout.chunks == ((0, 3), (9, 12))
    assert rank0.batch["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1]]  # padding positions restart at 0


def test_ulysses_shards_are_contiguous_and_need_no_padding_when_the_length_divides() -> None:
    batch = packed_batch((6, 4))
    shards = [shard_batch(batch, rank, 2, "ulysses") for rank in range(2)]
    assert [s.layout.chunks for s in shards] == [((0, 5),), ((5, 10),)]
    assert shards[0].layout.padding == 0 and shards[0].layout.cu_seq_lens.tolist() == [0, 6, 10]
    assert torch.equal(torch.cat([s.batch["input_ids"] for s in shards], dim=1), batch["input_ids"])


@pytest.mark.parametrize("cp_size", [2, 4])
def test_ring_order_is_torch_head_tail_order(cp_size: int) -> None:
    """torch's context_parallel shards with its head-tail balancer; ours must give every rank the same tokens."""
    balancer = pytest.importorskip("torch.distributed.tensor.experimental._context_parallel._load_balancer")
    length = 8 * cp_size
    torch_order = balancer._HeadTailLoadBalancer(length, cp_size, "cpu")._generate_indices()[0].tolist()
    batch = {"input_ids": torch.arange(length)[None], "labels": torch.arange(length)[None]}
    ours = [shard_batch(batch, rank, cp_size, "ring").batch["input_ids"][0].tolist() for rank in range(cp_size)]
    assert sum(ours, []) == torch_order


def test_counts_add_up_to_each_token_once() -> None:
    batch = packed_batch((7, 5, 6), pad_to_multiple_of=8)  # 18 real tokens + 6 of the collator's padding
    for method in ("ulysses", "ring"):
        shards = [shard_batch(batch, rank, 4, method) for rank in range(4)]
        assert sum(int((s.batch["shift_labels"] != -100).sum()) for s in shards) == 15  # each target once
        assert sum(s.batch["num_tokens"] for s in shards) == batch["num_tokens"] == 18


def test_rows_without_position_ids_get_global_positions() -> None:
    batch = {"input_ids": torch.arange(14).view(2, 7), "labels": torch.arange(14).view(2, 7),
             "attention_mask": torch.ones(2, 7, dtype=torch.long)}  # fmt: skip
    shard = shard_batch(batch, 1, 2, "ulysses")
    assert shard.batch["position_ids"].tolist() == [[4, 5, 6, 0], [4, 5, 6, 0]]
    assert "attention_mask" not in shard.batch and shard.layout.cu_seq_lens.tolist() == [0, 7, 8]
    assert shard.batch["shift_labels"].tolist() == [[5, 6, -100, -100], [12, 13, -100, -100]]


def test_attention_blocks_cover_each_query_within_its_document() -> None:
    layout = shard_batch(packed_batch((5, 9, 4)), 0, 2, "ring").layout  # 18 -> 20, chunks [0, 5) and [15, 20)
    blocks = attention_blocks(layout)
    assert [block[:4] for block in blocks] == [(0, 5, 0, 5), (5, 8, 14, 18), (8, 10, 18, 20)]
    assert blocks[0].mask is None and blocks[2].mask is None  # these start with their document: plain causal
    assert blocks[1].mask._materialize().tolist() == torch.ones(3, 4, dtype=torch.bool).tril(1).tolist()


def test_attention_blocks_of_a_million_token_row_allocate_no_dense_mask() -> None:
    """torch's own causal_lower_right would allocate [2, q, kv] fp32 here: terabytes."""
    documents = 1_048_576 // 4
    row = {"input_ids": torch.zeros(1, 1_048_576, dtype=torch.long), "labels": torch.zeros(1, 1_048_576, dtype=torch.long),
           "position_ids": torch.arange(documents).repeat(4)[None]}  # fmt: skip
    blocks = attention_blocks(shard_batch(row, 1, 4, "ring").layout)
    masks = [block.mask for block in blocks if block.mask is not None]
    assert [(mask.seq_len_q, mask.seq_len_kv) for mask in masks] == [(131_072, 262_144)]
    assert torch.Tensor.numel(masks[0]) == 0


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"attention_mask": torch.tensor([[1, 1, 1, 0]])}, "padding marked by attention_mask"),
        ({"cu_seq_lens_q": torch.tensor([0, 1, 4], dtype=torch.int32)}, "disagree on where the documents are"),
        ({"cu_seq_lens_q": torch.tensor([0, 3], dtype=torch.int32)}, "must rise from 0 to 4"),
        ({"labels": torch.zeros(1, 3, dtype=torch.long)}, "differ in shape"),
        ({"labels": None}, "needs 'labels' as a [batch, length] tensor, got missing"),
        ({"token_type_ids": torch.zeros(1, 4, dtype=torch.long)}, "['token_type_ids'] look per-token"),
    ],
)
def test_bad_batches_are_refused(change: dict, message: str) -> None:
    batch = {"input_ids": torch.arange(4)[None], "labels": torch.arange(4)[None],
             "position_ids": torch.tensor([[0, 1, 0, 1]])}  # fmt: skip
    batch.update(change)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        shard_batch({k: v for k, v in batch.items() if v is not None}, 0, 2, "ulysses")


def test_several_packed_rows_and_bad_sizes_are_refused() -> None:
    batch = {"input_ids": torch.zeros(2, 4, dtype=torch.long), "labels": torch.zeros(2, 4, dtype=torch.long),
             "position_ids": torch.tensor([[0, 1, 0, 1], [0, 1, 2, 3]])}  # fmt: skip
    with pytest.raises(ValueError, match="hold several documents"):
        shard_batch(batch, 0, 2, "ulysses")
    single = {"input_ids": torch.zeros(1, 4, dtype=torch.long), "labels": torch.zeros(1, 4, dtype=torch.long)}
    with pytest.raises(ValueError, match=r"cp_rank must be an int in \[0, 2\), got 2"):
        shard_batch(single, 2, 2, "ulysses")
    with pytest.raises(ValueError, match="method must be one of 'ulysses', 'ring', got 'star'"):
        shard_batch(single, 0, 2, "star")
