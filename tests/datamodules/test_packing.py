"""pack_dataset / plan_packing: exact Best-Fit Decreasing, token accounting, edge cases, TRL parity."""

from __future__ import annotations

from collections import defaultdict, deque

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
import torch
from datasets import Dataset

from lit_memtrain.datamodules.packing import pack_dataset
from lit_memtrain.datamodules.packing_plan import STRATEGIES, plan_packing


def reference_bfd(sizes: list[int], capacity: int) -> list[int]:
    """Textbook Best-Fit Decreasing; returns the sorted free space of each row."""
    free: list[int] = []
    for size in sorted(sizes, reverse=True):
        fits = [row for row, space in enumerate(free) if space >= size]
        if fits:
            best = min(fits, key=lambda row: free[row])
            free[best] -= size
        else:
            free.append(capacity - size)
    return sorted(free)


def unique_token_dataset(lengths: list[int]) -> Dataset:
    """Every token id is unique, and labels are input ids + 10**6, so misalignment shows."""
    ids, next_id = [], 0
    for length in lengths:
        ids.append(list(range(next_id, next_id + length)))
        next_id += length
    return Dataset.from_dict(
        {
            "input_ids": ids,
            "labels": [[token + 10**6 for token in row] for row in ids],
            "source": [f"example {index}" for index in range(len(lengths))],
        }
    )


def lognormal_lengths(count: int, seed: int = 0, high: int = 5000) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(np.rint(rng.lognormal(np.log(300), 1.0, count)), 1, high).astype(np.int64)


def check_rows(packed: Dataset, source: Dataset, max_length: int, strategy: str) -> None:
    """Rows fit, columns stay aligned, and each document is one contiguous slice of an example."""
    examples = {row[0]: row for row in source["input_ids"] if row}
    for row in packed:
        assert 0 < len(row["input_ids"]) <= max_length
        assert row["labels"] == [token + 10**6 for token in row["input_ids"]]
        if strategy == "wrapped":
            assert "seq_lengths" not in row
            continue
        assert sum(row["seq_lengths"]) == len(row["input_ids"])
        position = 0
        for length in row["seq_lengths"]:
            document = row["input_ids"][position : position + length]
            position += length
            first = document[0]
            example = next(e for start, e in examples.items() if start <= first < start + len(e))
            offset = first - example[0]
            assert offset % max_length == 0  # starts the example (bfd) or one of its chunks
            assert document == example[offset : offset + length]


@pytest.mark.parametrize("capacity", [1, 2, 7, 33, 64, 100, 300])
def test_plan_is_exact_best_fit_decreasing(capacity: int) -> None:
    rng = np.random.default_rng(capacity)
    for _ in range(40):
        sizes = rng.integers(1, capacity + 1, int(rng.integers(1, 60)))
        plan = plan_packing(sizes, capacity, "bfd")
        assert sorted((capacity - plan.row_lengths).tolist()) == reference_bfd(sizes.tolist(), capacity)
        assert sorted(plan.example.tolist()) == list(range(len(sizes)))


def test_plan_rows_on_a_hand_example() -> None:
    plan = plan_packing(np.array([5, 2, 3, 1]), 4, "bfd")
    rows = [plan.example[a:b].tolist() for a, b in zip(plan.row_offsets[:-1], plan.row_offsets[1:])]
    assert rows == [[0], [2, 3], [1]]
    assert plan.stop.tolist() == [4, 3, 1, 2]
    assert plan.row_lengths.tolist() == [4, 4, 2]


def test_plan_is_full_on_a_million_lengths() -> None:
    plan = plan_packing(lognormal_lengths(1_000_000, high=16384), 2048, "bfd")
    assert plan.row_lengths.max() <= 2048
    assert plan.fill >= 0.999


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_plan_is_deterministic(strategy: str) -> None:
    lengths = lognormal_lengths(3000)
    first, second = plan_packing(lengths, 1024, strategy), plan_packing(lengths, 1024, strategy)
    for name in ("example", "start", "stop", "row_offsets"):
        np.testing.assert_array_equal(getattr(first, name), getattr(second, name))


def test_bfd_keeps_exactly_the_first_max_length_tokens_of_each_example() -> None:
    lengths = [7, 0, 3, 12, 4, 4, 1, 9]
    source = unique_token_dataset(lengths)
    packed = pack_dataset(source, 4, "bfd")
    check_rows(packed, source, 4, "bfd")
    kept = sorted(token for row in source["input_ids"] for token in row[:4])
    assert sorted(token for row in packed["input_ids"] for token in row) == kept
    assert sum(map(len, source["input_ids"])) - len(kept) == 3 + 0 + 0 + 8 + 0 + 0 + 0 + 5
    assert packed.column_names == ["input_ids", "labels", "seq_lengths"]


def test_bfd_split_loses_no_token() -> None:
    lengths = [7, 0, 3, 12, 4, 4, 1, 9]
    source = unique_token_dataset(lengths)
    packed = pack_dataset(source, 4, "bfd_split")
    check_rows(packed, source, 4, "bfd_split")
    assert sorted(token for row in packed["input_ids"] for token in row) == list(range(sum(lengths)))


def test_wrapped_is_the_concatenation_cut_into_blocks() -> None:
    lengths = [7, 0, 3, 12, 4, 4, 1, 9]
    source = unique_token_dataset(lengths)
    packed = pack_dataset(source, 4, "wrapped")
    check_rows(packed, source, 4, "wrapped")
    assert [len(row) for row in packed["input_ids"]] == [4] * 10
    assert [token for row in packed["input_ids"] for token in row] == list(range(40))
    last = pack_dataset(unique_token_dataset([5, 5]), 4, "wrapped")
    assert last["input_ids"] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_random_datasets_fit_and_account_for_every_token(strategy: str) -> None:
    lengths = lognormal_lengths(400, seed=3, high=200).tolist()
    lengths[::37] = [0] * len(lengths[::37])
    source = unique_token_dataset(lengths)
    packed = pack_dataset(source, 64, strategy)
    check_rows(packed, source, 64, strategy)
    tokens = [token for row in packed["input_ids"] for token in row]
    expected = [token for row in source["input_ids"] for token in row[: 64 if strategy == "bfd" else None]]
    assert sorted(tokens) == expected
    assert pack_dataset(source, 64, strategy)["input_ids"] == packed["input_ids"]


def test_lengths_of_k_max_length_plus_one() -> None:
    source = unique_token_dataset([2 * 8 + 1, 3 * 8 + 1])
    split = pack_dataset(source, 8, "bfd_split")
    assert split["seq_lengths"] == [[8]] * 5 + [[1, 1]]
    assert sorted(token for row in split["input_ids"] for token in row) == list(range(42))
    truncated = pack_dataset(source, 8, "bfd")
    assert truncated["input_ids"] == [list(range(8)), list(range(17, 25))]
    assert truncated["seq_lengths"] == [[8], [8]]


def test_example_of_exactly_max_length_and_single_example() -> None:
    packed = pack_dataset(unique_token_dataset([8, 3, 5]), 8, "bfd")
    assert packed["input_ids"] == [list(range(8)), [11, 12, 13, 14, 15, 8, 9, 10]]
    assert packed["seq_lengths"] == [[8], [5, 3]]
    for strategy in STRATEGIES:
        single = pack_dataset(unique_token_dataset([3]), 8, strategy)
        assert single["input_ids"] == [[0, 1, 2]]
        assert single["labels"] == [[10**6, 10**6 + 1, 10**6 + 2]]


def test_empty_examples_and_empty_dataset() -> None:
    source = unique_token_dataset([0, 2, 0])
    for strategy in STRATEGIES:
        assert pack_dataset(source, 4, strategy)["input_ids"] == [[0, 1]]
    for strategy in STRATEGIES:
        assert len(pack_dataset(unique_token_dataset([0, 0]), 4, strategy)) == 0
    empty = pack_dataset(source.select([]), 4, "bfd")
    assert len(empty) == 0 and empty.column_names == ["input_ids", "labels", "seq_lengths"]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_selected_and_sliced_datasets_pack_only_their_own_rows(strategy: str) -> None:
    source = unique_token_dataset([5, 3, 9, 2, 6, 4, 7])
    keep = 4 if strategy == "bfd" else None

    selected = source.select([5, 2, 0])
    packed = pack_dataset(selected, 4, strategy)
    check_rows(packed, selected, 4, strategy)
    expected = sorted(token for row in selected["input_ids"] for token in row[:keep])
    assert sorted(token for row in packed["input_ids"] for token in row) == expected

    arrow_slice = source.with_format("arrow")[2:5]
    assert arrow_slice.column("input_ids").chunk(0).offset == 2  # offsets do not start at 0
    sliced = Dataset(arrow_slice)
    packed = pack_dataset(sliced, 4, strategy)
    check_rows(packed, sliced, 4, strategy)
    expected = sorted(token for row in source["input_ids"][2:5] for token in row[:keep])
    assert sorted(token for row in packed["input_ids"] for token in row) == expected


def test_format_and_large_list_columns_are_kept() -> None:
    source = unique_token_dataset([3, 5, 2]).with_format("torch")
    packed = pack_dataset(source, 8, "bfd")
    assert packed.format["type"] == "torch"
    assert isinstance(packed[0]["input_ids"], torch.Tensor)
    assert packed[0]["seq_lengths"].tolist() == [5, 3]

    table = pa.table({"input_ids": pa.array([[1, 2], [3], [4, 5, 6]], pa.large_list(pa.int64()))})
    packed = pack_dataset(Dataset(table), 3, "bfd_split")
    assert packed.data.column("input_ids").type == pa.large_list(pa.int64())
    assert packed["input_ids"] == [[4, 5, 6], [1, 2, 3]]


def test_errors_are_clear() -> None:
    source = unique_token_dataset([3, 2])
    for bad in (0, -4, 2.5, True):
        with pytest.raises(ValueError, match="max_length must be an integer >= 1"):
            pack_dataset(source, bad)
    with pytest.raises(ValueError, match="Unknown packing strategy 'ffd'; choose one of bfd, bfd_split, wrapped"):
        pack_dataset(source, 4, "ffd")
    with pytest.raises(ValueError, match="no list column to pack among \\['text'\\]"):
        pack_dataset(Dataset.from_dict({"text": ["a", "b"]}), 4)
    mismatched = source.add_column("attention_mask", [[1], [1, 1]])
    with pytest.raises(ValueError, match="Column 'attention_mask' does not have as many items"):
        pack_dataset(mismatched, 4)
    with pytest.raises(ValueError, match="lengths must be >= 0"):
        plan_packing(np.array([3, -1]), 4)
    with pytest.raises(ValueError, match="1-D array of integer token counts"):
        plan_packing(np.array([1.5, 2.0]), 4)


def test_same_rows_as_trl_on_its_documented_example() -> None:
    trl = pytest.importorskip("trl")
    examples = {
        "input_ids": [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10], [11]],
        "attention_mask": [[1, 1, 1, 0, 0], [1, 0], [1, 1, 0], [1]],
    }
    source = Dataset.from_dict(examples)
    for strategy in STRATEGIES:
        assert pack_dataset(source, 4, strategy)[:] == trl.pack_dataset(source, 4, strategy)[:]


@pytest.mark.parametrize("strategy", ["bfd", "bfd_split"])
def test_at_least_as_full_as_trl(strategy: str) -> None:
    trl = pytest.importorskip("trl")
    lengths = lognormal_lengths(6000, seed=1)
    offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int32)
    column = pa.ListArray.from_arrays(pa.array(offsets), pa.array(np.arange(offsets[-1], dtype=np.int32)))
    source = Dataset(pa.table({"input_ids": column}))
    ours = pack_dataset(source, 2048, strategy)
    theirs = trl.pack_dataset(source, 2048, strategy)
    ours_tokens = sum(map(len, ours["input_ids"]))
    assert ours_tokens == sum(map(len, theirs["input_ids"]))
    assert len(ours) <= len(theirs)
    assert ours_tokens / (len(ours) * 2048) >= 0.999


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_many_chunk_tables_and_non_numeric_columns(strategy: str) -> None:
    first = pa.table(
        {
            "input_ids": pa.array([[0, 1, 2], [3]], pa.list_(pa.int32())),
            "words": pa.array([["a", "b", "c"], ["d"]]),
            "mask": pa.array([[True, False, True], [None]], pa.list_(pa.bool_())),
        }
    )
    second = pa.table(
        {
            "input_ids": pa.array([[4, 5, 6, 7, 8], [], [9, 10]], pa.list_(pa.int32())),
            "words": pa.array([["e", "f", "g", "h", "i"], [], ["j", "k"]]),
            "mask": pa.array([[False] * 5, [], [True, True]], pa.list_(pa.bool_())),
        }
    )
    table = pa.concat_tables([first, second])
    assert table.column("input_ids").num_chunks == 2
    packed = pack_dataset(Dataset(table), 4, strategy)
    letters = "abcdefghijk"
    for row in packed:
        assert row["words"] == [letters[token] for token in row["input_ids"]]
    masks = {0: True, 1: False, 2: True, 3: None, 9: True, 10: True}
    flat = [(token, mask) for row in packed for token, mask in zip(row["input_ids"], row["mask"])]
    assert all(mask == masks.get(token, False) for token, mask in flat)
    expected = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    if strategy == "bfd":
        expected.remove(8)
    assert sorted(token for token, _ in flat) == expected


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_source_order_lists_segments_in_dataset_order(strategy: str) -> None:
    plan = plan_packing(lognormal_lengths(3000, seed=2), 1024, strategy)
    np.testing.assert_array_equal(plan.source_order, np.lexsort((plan.start, plan.example)))


def test_values_that_start_inside_their_buffer() -> None:
    values = pa.array(np.arange(100, 130, dtype=np.int64)).slice(5)
    column = pa.ListArray.from_arrays(pa.array([0, 4, 6, 11], pa.int32()), values)
    assert column.values.offset == 5
    packed = pack_dataset(Dataset(pa.table({"input_ids": column})), 6, "bfd")
    assert packed["input_ids"] == [[111, 112, 113, 114, 115], [105, 106, 107, 108, 109, 110]]


def per_item_best_fit_decreasing(sizes: list[int], capacity: int) -> tuple[list[int], list[int]]:
    """Best-Fit Decreasing one item at a time, ties first in, first out: (order, row_offsets)."""
    rows: list[list[int]] = []
    free: list[int] = []
    queues: dict[int, deque[int]] = defaultdict(deque)  # free space -> open rows, in arrival order
    for item in sorted(range(len(sizes)), key=lambda item: -sizes[item]):
        fits = [space for space, queue in queues.items() if space >= sizes[item] and queue]
        if fits:
            row = queues[min(fits)].popleft()
        else:
            row = len(rows)
            rows.append([])
            free.append(capacity)
        rows[row].append(item)
        free[row] -= sizes[item]
        if free[row]:
            queues[free[row]].append(row)
    return [item for row in rows for item in row], np.cumsum([0] + [len(row) for row in rows]).tolist()


@pytest.mark.parametrize("capacity", [1, 2, 5, 12, 64, 100, 1000, 70_000])
def test_best_fit_decreasing_places_item_by_item(capacity: int) -> None:
    """The plan moves rows a size class at a time; it must be exactly the per-item plan, ties included."""
    from lit_memtrain.datamodules.best_fit import best_fit_decreasing

    rng = np.random.default_rng(capacity)
    awkward = np.unique(np.clip([capacity, capacity // 2, capacity // 2 + 1, capacity // 3, capacity // 4,
                                 capacity - 1, 1, 2, 3], 1, capacity))
    for trial in range(60):
        count = int(rng.integers(0, 250))
        sizes = [
            rng.integers(1, capacity + 1, count),  # every size once or so
            rng.choice(awkward, count),  # sizes that divide the capacity or just miss: rows take several
            rng.integers(1, max(2, capacity // 10 + 1), count),  # many small items per row
            np.clip(np.rint(rng.lognormal(np.log(max(1, capacity / 8)), 1.0, count)), 1, capacity),
        ][trial % 4].astype(np.int64)
        order, row_offsets = best_fit_decreasing(sizes, capacity)
        expected_order, expected_offsets = per_item_best_fit_decreasing(sizes.tolist(), capacity)
        assert order.tolist() == expected_order, sizes.tolist()
        assert row_offsets.tolist() == expected_offsets, sizes.tolist()


def test_best_fit_decreasing_refuses_sizes_it_cannot_place() -> None:
    from lit_memtrain.datamodules.best_fit import best_fit_decreasing

    for sizes in ([100], [3, 9], [0, 2]):
        with pytest.raises(ValueError, match=r"every size must be in \[1, capacity=5\]"):
            best_fit_decreasing(np.array(sizes), 5)
    with pytest.raises(ValueError, match="capacity must be an integer >= 1"):
        best_fit_decreasing(np.array([1]), 0)
    with pytest.raises(ValueError, match="1-D array of integers"):
        best_fit_decreasing(np.array([1.0]), 5)
    order, row_offsets = best_fit_decreasing([], 5)
    assert order.size == 0 and row_offsets.tolist() == [0]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_non_nullable_items_and_chunks_read_in_place(strategy: str) -> None:
    item_type = pa.list_(pa.field("item", pa.int64(), nullable=False))
    chunks = [pa.array([[0, 1, 2], [3]], item_type), pa.array([[4, 5, 6, 7, 8], [], [9, 10]], item_type)]
    table = pa.Table.from_batches([pa.record_batch([chunk], names=["input_ids"]) for chunk in chunks])
    packed = pack_dataset(Dataset(table), 4, strategy)
    assert packed.data.column("input_ids").type.value_type == pa.int64()
    tokens = sorted(token for row in packed["input_ids"] for token in row)
    assert tokens == [token for token in range(11) if not (strategy == "bfd" and token == 8)]


def test_rows_are_split_into_chunks_that_32_bit_offsets_can_address() -> None:
    from lit_memtrain.datamodules.table_packing import _split_into_list_chunks

    flat = pa.array(np.arange(10, dtype=np.int32))
    row_offsets = np.array([0, 3, 4, 8, 10])
    column = _split_into_list_chunks(flat, row_offsets, pa.list_(pa.int32()), max_values=4)
    assert [len(chunk.values) for chunk in column.chunks] == [4, 4, 2]
    assert column.to_pylist() == [[0, 1, 2], [3], [4, 5, 6, 7], [8, 9]]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_no_garbage_collection_runs_while_a_table_is_packed(strategy: str) -> None:
    import gc
    import sys

    from lit_memtrain.datamodules.table_packing import pack_table

    lengths = lognormal_lengths(3000, seed=4)
    offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int32)
    values = pa.array(np.arange(offsets[-1], dtype=np.int32))
    table = pa.table({"input_ids": pa.ListArray.from_arrays(pa.array(offsets), values)}).slice(1)
    table = pa.concat_tables([table, pa.table({"input_ids": pa.array([None, [5]], pa.list_(pa.int32()))})])
    collections: list[str] = []

    def count(phase: str, info: dict) -> None:  # a collection that starts while packing code is running
        frame = sys._getframe(1)
        while phase == "start" and frame is not None:
            if "lit_memtrain" in frame.f_code.co_filename:
                collections.append(f"{frame.f_code.co_name} (generation {info['generation']})")
                return
            frame = frame.f_back

    threshold = gc.get_threshold()
    gc.set_threshold(1)  # without the pause, every tracked allocation would start a collection
    gc.callbacks.append(count)
    try:
        packed = pack_table(table, 512, strategy)
    finally:
        gc.callbacks.remove(count)
        gc.set_threshold(*threshold)
    assert collections == []
    assert gc.isenabled()
    kept = np.minimum(lengths[1:], 512) if strategy == "bfd" else lengths[1:]
    assert pc.sum(pc.list_value_length(packed["input_ids"])).as_py() == int(kept.sum()) + 1  # the null row is empty
    gc.disable()
    try:
        pack_table(table, 512, strategy)
        assert not gc.isenabled()  # a caller's choice is kept
    finally:
        gc.enable()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_plan_keeps_its_own_arrays(strategy: str) -> None:
    lengths = np.array([3, 1, 2], dtype=np.int64)  # int64 and none longer than a row: nothing to convert or cut
    plan = plan_packing(lengths, 4, strategy)
    lengths[:] = 0
    assert plan.num_tokens == 6 and sorted(plan.stop - plan.start) == [1, 2, 3]


def test_list_lengths_of_every_list_type() -> None:
    from lit_memtrain.datamodules.arrow_lists import list_lengths

    rows = [[1], [2, 3], None, []]
    for list_type in (pa.list_(pa.int32()), pa.large_list(pa.int32()), pa.list_view(pa.int32())):
        column = pa.chunked_array([pa.array(rows, list_type), pa.array([[4, 5, 6]], list_type)])
        assert list_lengths(column).tolist() == [1, 2, 0, 0, 3]
    fixed = pa.chunked_array([pa.array([[1, 2], [3, 4]], pa.list_(pa.int32(), 2))])
    assert list_lengths(fixed).tolist() == [2, 2]
