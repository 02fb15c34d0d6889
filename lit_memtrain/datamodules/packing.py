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
copied, in milliseconds: the module, loss and callbacks run where llvmlite is not installed.

Usage::

    from lit_memtrain.datamodules.packing import pack_dataset, plan_packing

    packed = pack_dataset(tokenised, max_length=2048, strategy="bfd")
    plan = plan_packing(np.array([5, 3, 2]), max_length=5, strategy="bfd")  # rows [0], [1, 2]
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
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

    Segment ``i`` is tokens ``start[i]:stop[i]`` of example ``example[i]``; row ``r`` is the
    concatenation of segments ``row_offsets[r]:row_offsets[r + 1]``. Rows come in the order they
    were opened, segments within a row in the order they were placed. ``source_order`` lists the
    segments in dataset order (by example, then start), the order in which copying them reads
    the source sequentially.
    """

    example: np.ndarray
    start: np.ndarray
    stop: np.ndarray
    row_offsets: np.ndarray
    max_length: int
    strategy: str
    source_order: np.ndarray

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
    from lit_memtrain.datamodules.best_fit import best_fit_decreasing

    order, row_offsets = best_fit_decreasing(stop - start, max_length)
    source_order = np.empty_like(order)
    source_order[order] = np.arange(len(order))
    return PackingPlan(
        example[order], start[order], stop[order], row_offsets, max_length, strategy, source_order
    )


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
        if not np.array_equal(_list_lengths(table[name]), lengths):
            raise ValueError(
                f"Column '{name}' does not have as many items per example as '{lengths_from}', so "
                f"it cannot be packed with it; remove it first (dataset.remove_columns(['{name}']))."
            )
    if strategy == "wrapped" and not any(table[name].null_count for name in names):
        return pa.table({name: _wrap_column(table[name], max_length) for name in names})
    compiling = None
    if any(_copied_by_segments(table[name]) for name in names):
        from lit_memtrain.datamodules.segment_copy import compile_in_background

        compiling = compile_in_background()  # llvmlite's import and compile overlap the plan (cold calls)
    plan = plan_packing(lengths, max_length, strategy)
    if compiling is not None:
        compiling.join()
    output = {name: _gather_rows(table[name], plan) for name in names}
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
        kept[piece_example],
        begin - offset,
        end - offset,
        row_offsets,
        max_length,
        "wrapped",
        np.arange(len(piece_example)),
    )


def _copied_by_segments(column: pa.ChunkedArray) -> bool:
    """Whether ``copy_segments`` copies this list column: fixed-width values without nulls."""
    value_type = column.type.value_type
    return (
        pa.types.is_primitive(value_type)
        and value_type.bit_width in (8, 16, 32, 64)
        and not any(chunk.values.null_count for chunk in column.chunks)
    )


def _gather_rows(column: pa.ChunkedArray, plan: PackingPlan) -> pa.ChunkedArray:
    """Copy one list column's planned segments, in plan order, into the packed rows.

    Fixed-width values without nulls (token ids, labels, masks stored as integers) are copied by
    ``copy_segments`` in dataset order, one thread per core, straight from each Arrow chunk's buffer.
    Other values (bit-packed booleans, strings, values with nulls) are concatenated and described as a
    list-view array (an offset and a size per segment, in any order) that Arrow flattens in C++.
    Offsets are read from the arrays themselves, so a sliced or selected dataset packs its own rows only.
    The output is split into chunks of fewer than 2**31 values when its type has 32-bit offsets.
    """
    chunks = [chunk for chunk in column.chunks if len(chunk)]
    example_chunk = np.repeat(np.arange(len(chunks)), [len(chunk) for chunk in chunks])
    example_offsets = np.concatenate([np.zeros(0, np.int64), *(c.offsets.to_numpy()[:-1] for c in chunks)])
    segment_chunks = example_chunk[plan.example]
    segment_starts = example_offsets[plan.example].astype(np.int64) + plan.start
    token_offsets = np.concatenate(([0], np.cumsum(plan.segment_lengths)))
    value_type = column.type.value_type
    if _copied_by_segments(column):
        from lit_memtrain.datamodules.segment_copy import copy_segments  # llvmlite, imported when used

        width = value_type.bit_width // 8
        sources = [
            np.frombuffer(c.values.buffers()[1], f"u{width}", count=len(c.values), offset=c.values.offset * width)
            for c in chunks
        ]
        order = plan.source_order
        size = int(token_offsets[-1])
        # Arrow's memory pool, like any Arrow column: it reuses freed pages, where a fresh numpy array of
        # this size would be mapped anew and zeroed page by page by the kernel (most of the copy's time).
        buffer = pa.allocate_buffer(size * width)
        copy_segments(
            sources,
            segment_chunks[order],
            segment_starts[order],
            plan.segment_lengths[order],
            token_offsets[:-1][order],
            size,
            _copy_workers(size),
            out=np.frombuffer(buffer, f"u{width}"),
        )
        flat = pa.Array.from_buffers(value_type, size, [None, buffer])
    else:
        first_offsets = np.array([c.offsets[0].as_py() for c in chunks], dtype=np.int64)
        used = [c.values.slice(first, c.offsets[-1].as_py() - first) for c, first in zip(chunks, first_offsets)]
        bases = np.concatenate(([0], np.cumsum([len(values) for values in used])))[:-1]
        views = pa.LargeListViewArray.from_arrays(
            pa.array(bases[segment_chunks] - first_offsets[segment_chunks] + segment_starts, pa.int64()),
            pa.array(plan.segment_lengths, pa.int64()),
            pa.concat_arrays(used) if used else pa.array([], value_type),
        )
        flat = views.flatten()
    return _split_into_list_chunks(flat, token_offsets[plan.row_offsets], column.type)


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
