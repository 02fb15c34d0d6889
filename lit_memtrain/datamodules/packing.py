"""Pack tokenised examples into rows of at most ``max_length`` tokens, globally and fast.

Why: padding a batch to its longest example wastes compute and memory on pad tokens; packing
several examples into one row (and keeping each document's length in ``seq_lengths`` so position
ids restart per document) wastes almost none. TRL packs each ``datasets.map`` batch of 1000 rows
separately with a pure-Python segment tree: slow, and the packing is only as full as a 1000-row
batch allows. Here the plan is made once over the whole dataset by Best-Fit Decreasing one size
class at a time (``best_fit``, numpy), and each column is copied into the planned rows by a compiled
loop that reads the source in order (``segment_copy``), never with a Python loop per token or per example.

Strategies (the contract of ``trl.pack_dataset``):

- ``"bfd"``: Best-Fit Decreasing over whole examples; tokens past ``max_length`` in one example
  are dropped. Keeps conversations intact (the SFT default).
- ``"bfd_split"``: cut long examples into chunks of at most ``max_length`` tokens first, then
  Best-Fit Decreasing; no token is lost (Fewer Truncations Improve Language Modeling,
  arXiv 2404.10830).
- ``"wrapped"``: concatenate every example and cut blocks of ``max_length`` tokens; the last
  block keeps the remainder. Fast and full, but cuts examples anywhere.

Nothing needs numba: the first call in a process is about as fast as the next (numba's start-up took
longer than the whole pack). The copy loop is compiled by llvmlite, imported only when a column is
copied, in milliseconds: the module, loss and callbacks run where llvmlite is not installed. What a
first call pays more than a later one is hidden or avoided: the output buffers are allocated before
the plan, so that another core maps their fresh pages while the plan is made (``CopyPreparation``);
the plan keeps the segments in dataset order, the order the copy reads them, so nothing is permuted
twice; and the garbage collector is paused while a table is packed.

Usage::

    from lit_memtrain.datamodules.packing import pack_dataset, plan_packing

    packed = pack_dataset(tokenised, max_length=2048, strategy="bfd")
    plan = plan_packing(np.array([5, 3, 2]), max_length=5, strategy="bfd")  # rows [0], [1, 2]
"""

from __future__ import annotations

import gc
import hashlib
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from itertools import pairwise
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

if TYPE_CHECKING:  # datasets is imported only when a dataset is packed (plan_packing does not need it)
    from datasets import Dataset, IterableDataset

    from lit_memtrain.datamodules.streaming import PackedStream

STRATEGIES: tuple[str, ...] = ("bfd", "bfd_split", "wrapped")


@dataclass(frozen=True)
class PackingPlan:
    """Which token slices of which examples make up each packed row, in order.

    The segments are listed in dataset order (by example, then start), the order in which copying them
    reads the source sequentially: segment ``i`` is tokens ``segment_start[i]:segment_stop[i]`` of example
    ``segment_example[i]``. ``order`` lists the segments row by row: row ``r`` is the concatenation of
    segments ``order[row_offsets[r]:row_offsets[r + 1]]``. Rows come in the order they were opened,
    segments within a row in the order they were placed. ``example``, ``start``, ``stop`` and
    ``segment_lengths`` describe the segments in that row order.
    """

    segment_example: np.ndarray
    segment_start: np.ndarray
    segment_stop: np.ndarray
    order: np.ndarray
    row_offsets: np.ndarray
    max_length: int
    strategy: str

    @property
    def num_rows(self) -> int:
        return len(self.row_offsets) - 1

    @cached_property
    def example(self) -> np.ndarray:
        return self.segment_example[self.order]

    @cached_property
    def start(self) -> np.ndarray:
        return self.segment_start[self.order]

    @cached_property
    def stop(self) -> np.ndarray:
        return self.segment_stop[self.order]

    @cached_property
    def segment_lengths(self) -> np.ndarray:
        """Tokens in each segment, in row order."""
        return (self.segment_stop - self.segment_start)[self.order]

    @cached_property
    def source_order(self) -> np.ndarray:
        """Where each segment of the dataset order stands in the row order (the inverse of ``order``)."""
        source_order = np.empty_like(self.order)
        source_order[self.order] = np.arange(len(self.order))
        return source_order

    @cached_property
    def token_offsets(self) -> np.ndarray:
        """Where each segment, in row order, starts in the concatenated rows; the token count last."""
        offsets = np.zeros(len(self.order) + 1, dtype=np.int64)
        np.cumsum(self.segment_lengths, out=offsets[1:])
        return offsets

    @cached_property
    def destination_starts(self) -> np.ndarray:
        """Where each segment, in dataset order, starts in the concatenated rows."""
        starts = np.empty(len(self.order), dtype=np.int64)
        starts[self.order] = self.token_offsets[:-1]
        return starts

    @property
    def row_lengths(self) -> np.ndarray:
        return np.diff(self.token_offsets[self.row_offsets])

    @property
    def num_tokens(self) -> int:
        return int(self.token_offsets[-1])

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
    return _place_segments(_cut_segments(lengths, max_length, strategy), max_length, strategy)


Segments = tuple[np.ndarray, np.ndarray, np.ndarray]  # example, start, stop of each token slice, in dataset order


def _cut_segments(lengths: np.ndarray, max_length: int, strategy: str) -> Segments:
    """The token slices that the strategy packs, in dataset order (empty examples left out): each example
    cut to ``max_length`` (``"bfd"``), cut into chunks of ``max_length`` (``"bfd_split"``), or cut where the
    blocks of the concatenation end (``"wrapped"``)."""
    if lengths.all():  # no empty example: no copy
        kept = np.arange(len(lengths))
    else:
        kept = np.flatnonzero(lengths)
        lengths = lengths[kept]
    if strategy == "bfd":
        return kept, np.zeros(len(kept), dtype=np.int64), np.minimum(lengths, max_length)
    if strategy == "bfd_split":
        return _split_into_chunks(kept, lengths, max_length)
    return _cut_at_block_ends(kept, lengths, max_length)


def _place_segments(segments: Segments, max_length: int, strategy: str) -> PackingPlan:
    """Rows of the segments: Best-Fit Decreasing, or, for ``"wrapped"``, each block of the concatenation."""
    example, start, stop = segments
    if strategy == "wrapped":
        token_starts = np.cumsum(stop - start) - (stop - start)
        blocks = token_starts // max_length
        num_rows = int(blocks[-1]) + 1 if len(blocks) else 0
        order, row_offsets = np.arange(len(example)), np.searchsorted(blocks, np.arange(num_rows + 1))
    else:
        from lit_memtrain.datamodules.best_fit import best_fit_decreasing

        order, row_offsets = best_fit_decreasing(stop - start, max_length)
    return PackingPlan(example, start, stop, order, row_offsets, max_length, strategy)


def pack_dataset(
    dataset: Dataset | IterableDataset, max_length: int, strategy: str = "bfd", buffer_size: int = 1000
) -> Dataset | PackedStream:
    """Pack every list column of ``dataset`` into rows of at most ``max_length`` tokens.

    Same contract as ``trl.pack_dataset``: all list columns (``input_ids``, ``labels``, masks)
    are packed together and must have the same length per example; non-list columns are
    dropped; ``"bfd"`` and ``"bfd_split"`` add ``seq_lengths``, the length of each document in a
    row. The plan is global over the dataset (not per ``map`` batch) and the output keeps the
    dataset's format. With ``"bfd"`` / ``"bfd_split"`` shuffle the packed rows (the plan sorts by
    length, so shuffling before only reorders ties); with ``"wrapped"`` shuffle before packing.

    A ``datasets.IterableDataset`` is packed on the fly, ``buffer_size`` examples at a time, into a
    :class:`~lit_memtrain.datamodules.streaming.PackedStream` (a resumable torch ``IterableDataset``
    of rows): host memory stays flat however long the stream.
    """
    _check_max_length(max_length)
    _check_strategy(strategy)
    import datasets

    if isinstance(dataset, datasets.IterableDataset):
        from lit_memtrain.datamodules.streaming import PackedStream

        return PackedStream(dataset, max_length, strategy, buffer_size=buffer_size, shuffle=False)
    schema = dataset.data.schema
    packed_names = _list_columns(schema)
    if dataset._indices is None:  # not selected or shuffled: its table holds its rows, as they are
        table = dataset.data.table.select(packed_names)
    else:
        table = dataset.select_columns(packed_names).with_format("arrow")[:]
    packed_table = pack_table(table, max_length, strategy)
    from datasets import DatasetInfo, Features

    features = Features.from_arrow_schema(packed_table.schema)
    features.update({name: dataset.features[name] for name in packed_names})
    fingerprint = hashlib.sha256(
        f"{dataset._fingerprint}|pack_dataset|{max_length}|{strategy}".encode()
    ).hexdigest()[:16]
    packed = datasets.Dataset(packed_table, info=DatasetInfo(features=features), fingerprint=fingerprint)
    return _with_same_format(packed, dataset.format)


@contextmanager
def _collector_paused() -> Iterator[None]:
    """Pause Python's garbage collector (a decorator of :func:`pack_table`). Packing makes no reference
    cycles, but its first call imports llvmlite (~7,000 new objects), and a collection that this triggers
    may be a full one, which in a process holding torch and transformers (~500,000 objects) takes
    0.2-0.3 s here, longer than the whole pack."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@_collector_paused()
def pack_table(table: pa.Table, max_length: int, strategy: str = "bfd") -> pa.Table:
    """Pack the list columns of an Arrow ``table`` (one example per row) into rows of ``max_length`` tokens.

    The core of :func:`pack_dataset`, also used window by window when streaming. ``"wrapped"`` copies
    nothing: each block of ``max_length`` tokens that lies within one Arrow chunk is a slice of that
    chunk's values; only blocks that straddle two chunks are copied.
    """
    _check_max_length(max_length)
    _check_strategy(strategy)
    names = _list_columns(table.schema)
    lengths_from = "input_ids" if "input_ids" in names else names[0]
    lengths = _list_lengths(table[lengths_from])
    for name in names:
        if name != lengths_from and not np.array_equal(_list_lengths(table[name]), lengths):
            raise ValueError(
                f"Column '{name}' does not have as many items per example as '{lengths_from}', so "
                f"it cannot be packed with it; remove it first (dataset.remove_columns(['{name}']))."
            )
    if strategy == "wrapped" and not any(table[name].null_count for name in names):
        return pa.table({name: _wrap_column(table[name], max_length) for name in names})
    num_tokens = int((np.minimum(lengths, max_length) if strategy == "bfd" else lengths).sum())
    # Arrow's memory pool, like any Arrow column: it reuses freed pages, where a fresh numpy array would be
    # mapped anew. Allocated before the plan, so that their fresh pages are mapped while it is made.
    destinations = {
        name: pa.allocate_buffer(num_tokens * table[name].type.value_type.bit_width // 8)
        for name in names
        if _copied_by_segments(table[name])
    }
    preparation = None
    if destinations:
        from lit_memtrain.datamodules.segment_copy import CopyPreparation

        preparation = CopyPreparation([np.frombuffer(buffer, np.uint8) for buffer in destinations.values()])
    try:
        plan = plan_packing(lengths, max_length, strategy)
    finally:
        if preparation is not None:
            preparation.finish()
    output = {name: _gather_rows(table[name], plan, destinations.get(name)) for name in names}
    if strategy != "wrapped":
        output["seq_lengths"] = pa.ListArray.from_arrays(
            pa.array(plan.row_offsets, pa.int32()), pa.array(plan.segment_lengths, pa.int32())
        )
    return pa.table(output)


def _wrap_column(column: pa.ChunkedArray, max_length: int) -> pa.ChunkedArray:
    """The concatenation of a list column's values cut into rows of ``max_length`` (the last row shorter).

    Rows inside one chunk point into that chunk's values (no copy); a row that spans chunks is copied.
    """
    large = pa.types.is_large_list(column.type)
    array_type = pa.LargeListArray if large else pa.ListArray
    offset_type = pa.int64() if large else pa.int32()
    pieces, partial, partial_length = [], [], 0

    def close_partial() -> None:
        values = pa.concat_arrays(partial) if len(partial) > 1 else partial[0]
        pieces.append(array_type.from_arrays(pa.array([0, len(values)], offset_type), values, type=column.type))

    for chunk in column.chunks:
        offsets = chunk.offsets.to_numpy()
        if not len(chunk) or offsets[-1] == offsets[0]:
            continue
        first, count = int(offsets[0]), int(offsets[-1] - offsets[0])
        position = 0
        if partial_length:
            take = min(max_length - partial_length, count)
            partial.append(chunk.values.slice(first, take))
            partial_length, position = partial_length + take, take
            if partial_length == max_length:
                close_partial()
                partial, partial_length = [], 0
        full_rows = (count - position) // max_length
        if full_rows:
            row_offsets = first + position + max_length * np.arange(full_rows + 1, dtype=np.int64)
            pieces.append(array_type.from_arrays(pa.array(row_offsets, offset_type), chunk.values, type=column.type))
        rest = position + full_rows * max_length
        if rest < count:
            partial, partial_length = [chunk.values.slice(first + rest, count - rest)], count - rest
    if partial_length:
        close_partial()
    return pa.chunked_array(pieces, column.type)


def _split_into_chunks(
    example: np.ndarray, lengths: np.ndarray, max_length: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Cut each example (``lengths`` >= 1) into consecutive chunks of ``max_length`` tokens (the last shorter).

    Only the few examples longer than a row are cut (in small arrays); every other one is its own
    chunk, so the full-size arrays are three: each chunk's example, start and stop.
    """
    chunks = (lengths - 1) // max_length + 1
    if not len(lengths) or int(chunks.max()) == 1:
        return example, np.zeros(len(example), dtype=np.int64), lengths.copy()  # the plan owns its arrays
    long = np.flatnonzero(chunks > 1)
    long_chunks = chunks[long]
    index = np.arange(int(long_chunks.sum())) - np.repeat(np.cumsum(long_chunks) - long_chunks, long_chunks)
    position = np.repeat((np.cumsum(chunks) - chunks)[long], long_chunks) + index
    start = np.zeros(int(chunks.sum()), dtype=np.int64)
    start[position] = index * max_length
    stop = np.repeat(lengths, chunks)
    stop[position] = np.minimum((index + 1) * max_length, np.repeat(lengths[long], long_chunks))
    return np.repeat(example, chunks), start, stop


def _cut_at_block_ends(example: np.ndarray, lengths: np.ndarray, max_length: int) -> Segments:
    """Cut each example where a block of ``max_length`` tokens of the concatenation ends."""
    ends = np.cumsum(lengths)
    starts = ends - lengths
    first_block, last_block = starts // max_length, (ends - 1) // max_length
    pieces = last_block - first_block + 1
    piece_example = np.repeat(np.arange(len(example)), pieces)
    block = np.repeat(first_block, pieces) + np.arange(int(pieces.sum())) - np.repeat(
        np.cumsum(pieces) - pieces, pieces
    )
    offset = starts[piece_example]
    begin = np.maximum(block * max_length, offset)
    end = np.minimum((block + 1) * max_length, ends[piece_example])
    return example[piece_example], begin - offset, end - offset


def _copied_by_segments(column: pa.ChunkedArray) -> bool:
    """Whether ``copy_segments`` copies this list column: fixed-width values without nulls."""
    value_type = column.type.value_type
    return (
        pa.types.is_primitive(value_type)
        and value_type.bit_width in (8, 16, 32, 64)
        and not any(chunk.values.null_count for chunk in column.chunks)
    )


def _gather_rows(column: pa.ChunkedArray, plan: PackingPlan, destination: pa.Buffer | None = None) -> pa.ChunkedArray:
    """Copy one list column's planned segments, in plan order, into the packed rows.

    Fixed-width values without nulls (token ids, labels, masks stored as integers) are copied by
    ``copy_segments`` in dataset order, one thread per core, straight from each Arrow chunk's buffer, into
    ``destination`` (allocated by the caller; a new buffer when None). Other values (bit-packed booleans,
    strings, values with nulls) are concatenated and described as a list-view array (an offset and a size
    per segment, in any order) that Arrow flattens in C++. Offsets are read from the arrays themselves, so a
    sliced or selected dataset packs its own rows only. The output is split into chunks of fewer than 2**31
    values when its type has 32-bit offsets.
    """
    chunks = [chunk for chunk in column.chunks if len(chunk)]
    if len(chunks) == 1:
        segment_chunks = np.zeros(len(plan.segment_example), dtype=np.int64)
        segment_starts = chunks[0].offsets.to_numpy()[plan.segment_example] + plan.segment_start
    else:
        example_chunk = np.repeat(np.arange(len(chunks)), [len(chunk) for chunk in chunks])
        example_offsets = np.concatenate([np.zeros(0, np.int64), *(c.offsets.to_numpy()[:-1] for c in chunks)])
        segment_chunks = example_chunk[plan.segment_example]
        segment_starts = example_offsets[plan.segment_example] + plan.segment_start
    value_type = column.type.value_type
    if _copied_by_segments(column):
        from lit_memtrain.datamodules.segment_copy import copy_segments  # llvmlite, imported when used

        width = value_type.bit_width // 8
        sources = [
            np.frombuffer(c.values.buffers()[1], f"u{width}", count=len(c.values), offset=c.values.offset * width)
            for c in chunks
        ]
        size = plan.num_tokens
        buffer = pa.allocate_buffer(size * width) if destination is None else destination
        copy_segments(
            sources,
            segment_chunks,
            segment_starts,
            plan.segment_stop - plan.segment_start,
            plan.destination_starts,
            size,
            _copy_workers(size),
            out=np.frombuffer(buffer, f"u{width}"),
        )
        flat = pa.Array.from_buffers(value_type, size, [None, buffer])
    else:
        first_offsets = np.array([c.offsets[0].as_py() for c in chunks], dtype=np.int64)
        used = [c.values.slice(first, c.offsets[-1].as_py() - first) for c, first in zip(chunks, first_offsets)]
        bases = np.concatenate(([0], np.cumsum([len(values) for values in used])))[:-1]
        views = pa.LargeListViewArray.from_arrays(  # in row order: Arrow flattens them in that order
            pa.array((bases[segment_chunks] - first_offsets[segment_chunks] + segment_starts)[plan.order], pa.int64()),
            pa.array(plan.segment_lengths, pa.int64()),
            pa.concat_arrays(used) if used else pa.array([], value_type),
        )
        flat = views.flatten()
    return _split_into_list_chunks(flat, plan.token_offsets[plan.row_offsets], column.type)


def _split_into_list_chunks(
    flat: pa.Array, row_offsets: np.ndarray, list_type: pa.DataType, max_values: int | None = None
) -> pa.ChunkedArray:
    """Rows ``flat[row_offsets[r]:row_offsets[r + 1]]`` as a list column, in chunks of at most ``max_values``
    values (by default as many as the type's offsets can address: 2**31 - 1 for ``list``)."""
    large = pa.types.is_large_list(list_type)
    limit = max_values or np.iinfo(np.int64 if large else np.int32).max
    cuts = [0]
    while row_offsets[-1] - row_offsets[cuts[-1]] > limit:
        cuts.append(int(np.searchsorted(row_offsets, row_offsets[cuts[-1]] + limit, side="right")) - 1)
    cuts.append(len(row_offsets) - 1)
    array_type = pa.LargeListArray if large else pa.ListArray
    offset_type = pa.int64() if large else pa.int32()
    pieces = []
    for first, last in pairwise(cuts):
        offsets = row_offsets[first : last + 1] - row_offsets[first]
        values = flat.slice(int(row_offsets[first]), int(offsets[-1]))
        pieces.append(array_type.from_arrays(pa.array(offsets, offset_type), values, type=list_type))
    return pa.chunked_array(pieces, list_type)


_TOKENS_PER_COPY_WORKER = 4_000_000


def _copy_workers(num_tokens: int) -> int:
    """Threads for the copy: one per core, but none for small copies where threads cost more than they save."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cores, 8, num_tokens // _TOKENS_PER_COPY_WORKER))


def _list_lengths(column: pa.ChunkedArray) -> np.ndarray:
    """Items per row of a list column (0 for a null row), from the offsets of list chunks without nulls."""
    pieces = [
        np.diff(chunk.offsets.to_numpy()).astype(np.int64, copy=False)
        if not chunk.null_count and _is_list_type(chunk.type)
        else pc.list_value_length(chunk).fill_null(0).to_numpy().astype(np.int64)
        for chunk in column.chunks
    ]
    return pieces[0] if len(pieces) == 1 else np.concatenate([np.zeros(0, np.int64), *pieces])


def _with_same_format(packed: Dataset, dataset_format: dict) -> Dataset:
    columns = dataset_format.get("columns")
    if columns is not None:
        columns = [name for name in columns if name in packed.column_names]
        if "seq_lengths" in packed.column_names:
            columns.append("seq_lengths")
    same_format = {
        "type": dataset_format.get("type"),
        "format_kwargs": dataset_format.get("format_kwargs", {}),
        "columns": packed.column_names if columns is None else columns,
        "output_all_columns": dataset_format.get("output_all_columns", False),
    }
    if packed.format == same_format:  # the default format: no new fingerprint to hash
        return packed
    return packed.with_format(
        same_format["type"],
        columns=columns,
        output_all_columns=same_format["output_all_columns"],
        **same_format["format_kwargs"],
    )


def _list_columns(schema: pa.Schema) -> list[str]:
    names = [name for name in schema.names if _is_list_type(schema.field(name).type)]
    if not names:
        raise ValueError(
            f"pack_dataset found no list column to pack among {schema.names}; "
            "tokenise first so that `input_ids` holds one list of token ids per example."
        )
    return names


def _is_list_type(arrow_type: pa.DataType) -> bool:
    return pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type)


def _check_lengths(lengths: np.ndarray) -> np.ndarray:
    lengths = np.asarray(lengths)
    if lengths.ndim != 1 or not (np.issubdtype(lengths.dtype, np.integer) or lengths.size == 0):
        raise ValueError(
            f"lengths must be a 1-D array of integer token counts, got shape {lengths.shape} "
            f"and dtype {lengths.dtype}."
        )
    lengths = lengths.astype(np.int64, copy=False)
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
