"""Copy the list columns of an Arrow table into the packed rows that a plan lays out, fast.

Why: the plan (:mod:`~lit_memtrain.datamodules.packing_plan`) says which token slices make each row; this module
makes the rows, never with a Python loop per token or per example. Each column is copied into the planned rows
by a compiled loop that reads the source in order (:mod:`~lit_memtrain.datamodules.segment_copy`), and
``"wrapped"`` copies almost nothing (its rows are slices of the source). A whole dataset is packed with it
(:func:`~lit_memtrain.datamodules.packing.pack_dataset`), and a stream one window at a time
(:class:`~lit_memtrain.datamodules.streaming.PackedStream`).

Nothing needs numba: the first call in a process is about as fast as the next (numba's start-up took
longer than the whole pack). The copy loop is compiled by llvmlite, imported only when a column is
copied, in milliseconds: the module, loss and callbacks run where llvmlite is not installed. What a
first call pays more than a later one is hidden or avoided: the output buffers are allocated before
the plan, so that another core maps their fresh pages while the plan is made (``CopyPreparation``);
the plan keeps the segments in dataset order, the order the copy reads them, so nothing is permuted
twice; and the garbage collector is paused while a table is packed.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from contextlib import contextmanager
from itertools import pairwise

import numpy as np
import pyarrow as pa

from lit_memtrain.datamodules.arrow_lists import is_list_type, list_lengths
from lit_memtrain.datamodules.packing_plan import PackingPlan, check_max_length, check_strategy, plan_packing

__all__ = ["list_columns", "pack_table"]


def list_columns(schema: pa.Schema) -> list[str]:
    """The names of the list columns that packing packs together; a ValueError when there is none."""
    names = [name for name in schema.names if is_list_type(schema.field(name).type)]
    if not names:
        raise ValueError(
            f"pack_dataset found no list column to pack among {schema.names}; "
            "tokenise first so that `input_ids` holds one list of token ids per example."
        )
    return names


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

    The core of :func:`~lit_memtrain.datamodules.packing.pack_dataset`, also used window by window when
    streaming. ``"wrapped"`` copies nothing: each block of ``max_length`` tokens that lies within one Arrow
    chunk is a slice of that chunk's values; only blocks that straddle two chunks are copied.
    """
    check_max_length(max_length)
    check_strategy(strategy)
    names = list_columns(table.schema)
    lengths_from = "input_ids" if "input_ids" in names else names[0]
    lengths = list_lengths(table[lengths_from])
    for name in names:
        if name != lengths_from and not np.array_equal(list_lengths(table[name]), lengths):
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
