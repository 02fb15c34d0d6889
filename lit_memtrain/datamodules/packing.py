"""Pack tokenised examples into rows of at most ``max_length`` tokens, globally and fast.

Why: padding a batch to its longest example wastes compute and memory on pad tokens; packing
several examples into one row (and keeping each document's length in ``seq_lengths`` so position
ids restart per document) wastes almost none. TRL packs each ``datasets.map`` batch of 1000 rows
separately with a pure-Python segment tree: slow, and the packing is only as full as a 1000-row
batch allows. Here the plan is made once over the whole dataset with vectorised numpy, and each
column is copied into the planned rows by Arrow in one C++ pass over a list-view of its segments,
never with a Python loop per token or per example.

Strategies (the contract of ``trl.pack_dataset``):

- ``"bfd"``: Best-Fit Decreasing over whole examples; tokens past ``max_length`` in one example
  are dropped. Keeps conversations intact (the SFT default).
- ``"bfd_split"``: cut long examples into chunks of at most ``max_length`` tokens first, then
  Best-Fit Decreasing; no token is lost (Fewer Truncations Improve Language Modeling,
  arXiv 2404.10830).
- ``"wrapped"``: concatenate every example and cut blocks of ``max_length`` tokens; the last
  block keeps the remainder. Fast and full, but cuts examples anywhere.

How Best-Fit Decreasing stays exact and vectorised: items are taken longest first, and the open
rows are only counted per remaining capacity (``count[c]`` = rows with ``c`` tokens free). All
items of one length ``s`` are placed in one step: the best fit for the first is the smallest
capacity ``c >= s`` with an open row, and that row then takes ``c // s`` items in a row (what is
left of it is still the smallest fit), so a cumulative sum over the capacities tells where every
item of the group lands. That is O(max_length / 64 + capacities in use) numpy work per distinct
length, instead of one tree search per item, and O(n log n) overall. Which row an item joined is
recovered afterwards: each placement moves a row from capacity ``c`` to ``c - s``, so matching
the i-th departure from ``c`` to the i-th arrival at ``c`` (first in, first out) links every item
to the item placed before it in the same row; pointer jumping then finds each row's first item.

Usage::

    from lit_memtrain.datamodules.packing import pack_dataset, plan_packing

    packed = pack_dataset(tokenised, max_length=2048, strategy="bfd")
    plan = plan_packing(np.array([5, 3, 2]), max_length=5, strategy="bfd")  # rows [0], [1, 2]
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

if TYPE_CHECKING:  # datasets is imported only when a dataset is packed (plan_packing needs numpy alone)
    from datasets import Dataset

STRATEGIES: tuple[str, ...] = ("bfd", "bfd_split", "wrapped")


@dataclass(frozen=True)
class PackingPlan:
    """Which token slices of which examples make up each packed row, in order.

    Segment ``i`` is tokens ``start[i]:stop[i]`` of example ``example[i]``; row ``r`` is the
    concatenation of segments ``row_offsets[r]:row_offsets[r + 1]``. Rows come in the order they
    were opened, segments within a row in the order they were placed.
    """

    example: np.ndarray
    start: np.ndarray
    stop: np.ndarray
    row_offsets: np.ndarray
    max_length: int
    strategy: str

    @property
    def num_rows(self) -> int:
        return len(self.row_offsets) - 1

    @property
    def segment_lengths(self) -> np.ndarray:
        return self.stop - self.start

    @property
    def row_lengths(self) -> np.ndarray:
        token_ends = np.concatenate(([0], np.cumsum(self.segment_lengths)))
        return np.diff(token_ends[self.row_offsets])

    @property
    def num_tokens(self) -> int:
        return int(self.segment_lengths.sum())

    @property
    def fill(self) -> float:
        """Share of the ``num_rows * max_length`` token slots that hold a real token."""
        if self.num_rows == 0:
            return 0.0
        return self.num_tokens / (self.num_rows * self.max_length)


def plan_packing(lengths: np.ndarray, max_length: int, strategy: str = "bfd") -> PackingPlan:
    """Plan how examples of the given token ``lengths`` pack into rows of ``max_length`` tokens.

    Empty examples (length 0) are left out. Deterministic: equal lengths keep dataset order.
    """
    lengths = _check_lengths(lengths)
    _check_max_length(max_length)
    _check_strategy(strategy)
    if strategy == "wrapped":
        return _plan_wrapped(lengths, max_length)
    kept = np.flatnonzero(lengths)
    if strategy == "bfd":
        example, start = kept, np.zeros(len(kept), dtype=np.int64)
        stop = np.minimum(lengths[kept], max_length)
    else:
        example, start, stop = _split_into_chunks(kept, lengths[kept], max_length)
    order, row_offsets = _best_fit_decreasing(stop - start, max_length)
    return PackingPlan(example[order], start[order], stop[order], row_offsets, max_length, strategy)


def pack_dataset(dataset: Dataset, max_length: int, strategy: str = "bfd") -> Dataset:
    """Pack every list column of ``dataset`` into rows of at most ``max_length`` tokens.

    Same contract as ``trl.pack_dataset``: all list columns (``input_ids``, ``labels``, masks)
    are packed together and must have the same length per example; non-list columns are
    dropped; ``"bfd"`` and ``"bfd_split"`` add ``seq_lengths``, the length of each document in a
    row. The plan is global over the dataset (not per ``map`` batch) and the output keeps the
    dataset's format. With ``"bfd"`` / ``"bfd_split"`` shuffle the packed rows (the plan sorts by
    length, so shuffling before only reorders ties); with ``"wrapped"`` shuffle before packing.
    """
    _check_max_length(max_length)
    _check_strategy(strategy)
    schema = dataset.data.schema
    packed_names = [name for name in schema.names if _is_list_type(schema.field(name).type)]
    if not packed_names:
        raise ValueError(
            f"pack_dataset found no list column to pack among {schema.names}; "
            "tokenise first so that `input_ids` holds one list of token ids per example."
        )
    table = dataset.select_columns(packed_names).with_format("arrow")[:]
    lengths_from = "input_ids" if "input_ids" in packed_names else packed_names[0]
    lengths = _list_lengths(table[lengths_from])
    for name in packed_names:
        if not np.array_equal(_list_lengths(table[name]), lengths):
            raise ValueError(
                f"Column '{name}' does not have as many items per example as '{lengths_from}', so "
                f"it cannot be packed with it; remove it first (dataset.remove_columns(['{name}']))."
            )
    plan = plan_packing(lengths, max_length, strategy)
    output = {name: _gather_rows(table[name], plan) for name in packed_names}
    if strategy != "wrapped":
        output["seq_lengths"] = pa.ListArray.from_arrays(
            pa.array(plan.row_offsets, pa.int32()), pa.array(plan.segment_lengths, pa.int32())
        )
    packed_table = pa.table(output)
    from datasets import Dataset, DatasetInfo, Features

    features = Features.from_arrow_schema(packed_table.schema)
    features.update({name: dataset.features[name] for name in packed_names})
    fingerprint = hashlib.sha256(
        f"{dataset._fingerprint}|pack_dataset|{max_length}|{strategy}".encode()
    ).hexdigest()[:16]
    packed = Dataset(packed_table, info=DatasetInfo(features=features), fingerprint=fingerprint)
    return _with_same_format(packed, dataset.format)


def _best_fit_decreasing(sizes: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """Best-Fit Decreasing of ``sizes`` (each in ``[1, capacity]``) into rows of ``capacity``.

    Returns ``(order, row_offsets)``: item indices in output order and where each row starts.
    """
    num_items = len(sizes)
    by_size = _stable_argsort(capacity - sizes, capacity)
    sorted_sizes = sizes[by_size]
    group_starts = np.flatnonzero(np.diff(sorted_sizes, prepend=-1))
    group_ends = np.append(group_starts[1:], num_items)
    open_rows = _OpenRows(capacity)
    departs_from = np.empty(num_items, dtype=np.int64)
    for first, end in zip(group_starts.tolist(), group_ends.tolist()):
        size, count = int(sorted_sizes[first]), end - first
        departs_from[first:end] = _place_group(open_rows, size, count, capacity, num_items)
    arrives_at = departs_from - sorted_sizes
    previous = _previous_in_row(departs_from, arrives_at, capacity)
    row_first = _follow_to_root(previous)
    output = np.argsort(row_first, kind="stable")
    row_first = row_first[output]
    row_offsets = np.append(np.flatnonzero(np.diff(row_first, prepend=-1)), num_items)
    return by_size[output], row_offsets


class _OpenRows:
    """How many open rows have each remaining capacity, with a total per block of 64 capacities
    so that finding the capacities ``>= size`` that have rows skips empty blocks (long
    ``max_length`` values would otherwise cost a full scan per distinct item size)."""

    BLOCK = 64

    def __init__(self, capacity: int) -> None:
        num_blocks = capacity // self.BLOCK + 1
        self.count = np.zeros(num_blocks * self.BLOCK, dtype=np.int64)
        self.block_count = np.zeros(num_blocks, dtype=np.int64)

    def capacities_at_least(self, size: int) -> np.ndarray:
        """Sorted capacities ``>= size`` that have at least one open row."""
        first_block = size // self.BLOCK
        blocks = np.flatnonzero(self.block_count[first_block:]) + first_block
        candidates = (blocks[:, None] * self.BLOCK + np.arange(self.BLOCK)).ravel()
        candidates = candidates[self.count[candidates] > 0]
        return candidates[candidates >= size]

    def add(self, capacities: np.ndarray, deltas: np.ndarray) -> None:
        np.add.at(self.count, capacities, deltas)
        np.add.at(self.block_count, capacities // self.BLOCK, deltas)


def _place_group(
    open_rows: _OpenRows, size: int, count: int, capacity: int, num_items: int
) -> np.ndarray:
    """Place ``count`` items of ``size``, updating ``open_rows``; return each one's capacity
    before it was placed (``capacity`` for an item that opens a new row)."""
    levels = np.append(open_rows.capacities_at_least(size), capacity)
    rows = np.append(open_rows.count[levels[:-1]], num_items)
    per_row = levels // size
    cumulative = np.cumsum(rows * per_row)
    last = int(np.searchsorted(cumulative, count))
    placed_before = int(cumulative[last - 1]) if last else 0
    full_rows, leftover = divmod(count - placed_before, int(per_row[last]))
    taken_rows = np.append(rows[:last], full_rows)
    items_per_level = np.append(rows[:last] * per_row[:last], count - placed_before)

    changed = [levels[:last], levels[: last + 1] % size]
    deltas = [-rows[:last], taken_rows]
    if levels[last] < capacity:
        changed.append([levels[last]])
        deltas.append([-(full_rows + (leftover > 0))])
    if leftover:
        changed.append([levels[last] - leftover * size])
        deltas.append([1])
    open_rows.add(np.concatenate(changed), np.concatenate(deltas))

    level_of_item = np.repeat(np.arange(last + 1), items_per_level)
    index_in_level = np.arange(count) - np.repeat(
        np.cumsum(items_per_level) - items_per_level, items_per_level
    )
    return levels[level_of_item] - (index_in_level % per_row[level_of_item]) * size


def _previous_in_row(departs_from: np.ndarray, arrives_at: np.ndarray, capacity: int) -> np.ndarray:
    """For each placement, the placement that left its row at the capacity it took it from (the
    i-th departure from ``c`` is the i-th arrival at ``c``); a new row points to itself."""
    previous = np.arange(len(departs_from))
    arrivals = _stable_argsort(arrives_at, capacity)
    joins = np.flatnonzero(departs_from < capacity)
    joins = joins[_stable_argsort(departs_from[joins], capacity)]
    join_capacities = departs_from[joins]
    first_arrival = _first_index_of_each_value(arrives_at, capacity)
    first_join = _first_index_of_each_value(join_capacities, capacity)
    rank = np.arange(len(joins)) - first_join[join_capacities]
    previous[joins] = arrivals[first_arrival[join_capacities] + rank]
    return previous


def _first_index_of_each_value(values: np.ndarray, bound: int) -> np.ndarray:
    """Where each value in ``[0, bound]`` starts once ``values`` are sorted (counting sort)."""
    counts = np.bincount(values, minlength=bound + 1)
    return np.concatenate(([0], np.cumsum(counts)[:-1]))


def _stable_argsort(values: np.ndarray, bound: int) -> np.ndarray:
    """Stable argsort of values in ``[0, bound]``: numpy radix-sorts 16-bit integers in O(n)."""
    if bound <= np.iinfo(np.uint16).max:
        values = values.astype(np.uint16)
    return np.argsort(values, kind="stable")


def _follow_to_root(previous: np.ndarray) -> np.ndarray:
    """Pointer jumping: the first placement of each placement's row."""
    root = previous
    while True:
        jumped = root[root]
        if np.array_equal(jumped, root):
            return root
        root = jumped


def _split_into_chunks(
    example: np.ndarray, lengths: np.ndarray, max_length: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Cut each example into consecutive chunks of ``max_length`` tokens (the last shorter)."""
    chunks = -(-lengths // max_length)
    chunk_example = np.repeat(example, chunks)
    index = np.arange(int(chunks.sum())) - np.repeat(np.cumsum(chunks) - chunks, chunks)
    start = index * max_length
    stop = np.minimum(start + max_length, np.repeat(lengths, chunks))
    return chunk_example, start, stop


def _plan_wrapped(lengths: np.ndarray, max_length: int) -> PackingPlan:
    """Cut the concatenation of all examples into blocks: one segment per (example, block) pair."""
    kept = np.flatnonzero(lengths)
    ends = np.cumsum(lengths[kept])
    starts = ends - lengths[kept]
    first_block, last_block = starts // max_length, (ends - 1) // max_length
    pieces = last_block - first_block + 1
    piece_example = np.repeat(np.arange(len(kept)), pieces)
    block = np.repeat(first_block, pieces) + np.arange(int(pieces.sum())) - np.repeat(
        np.cumsum(pieces) - pieces, pieces
    )
    begin = np.maximum(block * max_length, starts[piece_example])
    end = np.minimum((block + 1) * max_length, ends[piece_example])
    offset = starts[piece_example]
    num_rows = int(last_block[-1]) + 1 if len(kept) else 0
    row_offsets = np.searchsorted(block, np.arange(num_rows + 1))
    return PackingPlan(
        kept[piece_example], begin - offset, end - offset, row_offsets, max_length, "wrapped"
    )


def _gather_rows(column: pa.ChunkedArray, plan: PackingPlan) -> pa.ChunkedArray:
    """Copy one list column's planned segments, in plan order, into the packed rows.

    The segments are described as a list-view array (an offset and a size per segment into the
    column's values buffer, in any order) and flattened, so Arrow copies them in C++. The copy is
    bound by memory bandwidth, so the rows are split into one contiguous block per CPU core, each
    flattened in its own thread (Arrow releases the GIL) into its own chunk of the output: nothing
    is copied twice. Offsets are read from the array itself, so a sliced or selected dataset packs
    its own rows only; a column of several chunks is combined first.
    """
    large = pa.types.is_large_list(column.type)
    offset_type = pa.int64() if large else pa.int32()
    token_offsets = np.concatenate(([0], np.cumsum(plan.segment_lengths)))[plan.row_offsets]
    array = column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()
    example_offsets = array.offsets.to_numpy()
    segment_starts = example_offsets[plan.example] + plan.start
    view_type = pa.LargeListViewArray if large else pa.ListViewArray
    list_type = pa.LargeListArray if large else pa.ListArray

    def copy_rows(first: int, last: int) -> pa.Array:
        segments = slice(plan.row_offsets[first], plan.row_offsets[last])
        views = view_type.from_arrays(
            pa.array(segment_starts[segments], offset_type),
            pa.array(plan.segment_lengths[segments], offset_type),
            array.values,
        )
        offsets = token_offsets[first : last + 1] - token_offsets[first]
        return list_type.from_arrays(pa.array(offsets, offset_type), views.flatten())

    blocks = _row_blocks(token_offsets, _copy_workers(int(token_offsets[-1])))
    if len(blocks) == 1:
        return pa.chunked_array([copy_rows(*blocks[0])], column.type)
    with ThreadPoolExecutor(len(blocks)) as pool:
        return pa.chunked_array(list(pool.map(lambda block: copy_rows(*block), blocks)), column.type)


_TOKENS_PER_COPY_WORKER = 4_000_000


def _copy_workers(num_tokens: int) -> int:
    """Threads for the copy: one per core, but none for small copies where threads cost more than they save."""
    return max(1, min(os.cpu_count() or 1, 8, num_tokens // _TOKENS_PER_COPY_WORKER))


def _row_blocks(token_offsets: np.ndarray, workers: int) -> list[tuple[int, int]]:
    """Split rows ``0..R`` into at most ``workers`` contiguous blocks of about equal token counts."""
    num_rows = len(token_offsets) - 1
    targets = np.linspace(0, token_offsets[-1], workers + 1)[1:-1]
    cuts = np.unique(np.concatenate(([0], np.searchsorted(token_offsets, targets), [num_rows])))
    return [(int(a), int(b)) for a, b in zip(cuts[:-1], cuts[1:]) if b > a] or [(0, num_rows)]


def _list_lengths(column: pa.ChunkedArray) -> np.ndarray:
    return pc.list_value_length(column).fill_null(0).to_numpy().astype(np.int64)


def _with_same_format(packed: Dataset, dataset_format: dict) -> Dataset:
    columns = dataset_format.get("columns")
    if columns is not None:
        columns = [name for name in columns if name in packed.column_names]
        if "seq_lengths" in packed.column_names:
            columns.append("seq_lengths")
    return packed.with_format(
        dataset_format.get("type"),
        columns=columns,
        output_all_columns=dataset_format.get("output_all_columns", False),
        **dataset_format.get("format_kwargs", {}),
    )


def _is_list_type(arrow_type: pa.DataType) -> bool:
    return pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type)


def _check_lengths(lengths: np.ndarray) -> np.ndarray:
    lengths = np.asarray(lengths)
    if lengths.ndim != 1 or not (np.issubdtype(lengths.dtype, np.integer) or lengths.size == 0):
        raise ValueError(
            f"lengths must be a 1-D array of integer token counts, got shape {lengths.shape} "
            f"and dtype {lengths.dtype}."
        )
    lengths = lengths.astype(np.int64)
    if lengths.size and lengths.min() < 0:
        raise ValueError(f"lengths must be >= 0, found {int(lengths.min())}.")
    return lengths


def _check_max_length(max_length: int) -> None:
    if isinstance(max_length, bool) or not isinstance(max_length, (int, np.integer)) or max_length < 1:
        raise ValueError(f"max_length must be an integer >= 1, got {max_length!r}.")


def _check_strategy(strategy: str) -> None:
    if strategy not in STRATEGIES:
        raise ValueError(
            f"Unknown packing strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}."
        )
