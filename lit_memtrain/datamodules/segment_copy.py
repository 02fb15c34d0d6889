"""Copy many slices of token buffers into one new buffer, reading the sources in order.

Why: packing a million examples copies about a million slices of ~500 tokens each, scattered over
gigabytes. Gathering them in output order reads the source at random, and each read of a new page
stalls the core on a TLB miss (worse under a VM's nested page tables), so a gather runs at a fraction
of memory bandwidth. Visiting the slices in source order reads the source sequentially and scatters the
writes instead, which the CPU buffers without stalling: about twice as fast. The loop is compiled with
numba (a Python loop per slice would cost more than the copy) and releases the GIL, so one thread per
core copies its own share of the slices. A dataset column is usually stored as many Arrow chunks, each
with its own buffer: the sources are read where they are (memory-mapped or not), never concatenated.

Each slice is one ``memcpy`` (LLVM's intrinsic) between byte addresses: the loop then has one signature
for every dtype, compiles in a fraction of a second (numba's slice assignment took seconds, per dtype)
and copies at memcpy speed. Bounds are checked in Python before the loop runs.

Usage::

    out = copy_segments([values], np.zeros(3), source_starts, lengths, destination_starts, size=12, workers=2)
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from itertools import pairwise

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic


@intrinsic
def _copy_bytes(typingctx, destination, source, count):  # noqa: ARG001 - numba's intrinsic signature
    """``memcpy(destination, source, count)`` on byte addresses (integers)."""

    def codegen(context, builder, signature, args):
        to, start, length = args
        byte = ir.IntType(8).as_pointer()
        cgutils.raw_memcpy(builder, builder.inttoptr(to, byte), builder.inttoptr(start, byte), length, 1)
        return context.get_dummy_value()

    return types.void(types.intp, types.intp, types.intp), codegen


@numba.njit(nogil=True, cache=True)
def _scatter(
    source: int,
    destination: int,
    width: int,
    source_starts: np.ndarray,
    lengths: np.ndarray,
    destination_starts: np.ndarray,
) -> None:
    """Copy ``lengths[i]`` items of ``width`` bytes from the ``source`` address to the ``destination`` one."""
    for index in range(len(source_starts)):
        _copy_bytes(
            destination + destination_starts[index] * width, source + source_starts[index] * width, lengths[index] * width
        )


def copy_segments(
    sources: Sequence[np.ndarray],
    segment_sources: np.ndarray,
    source_starts: np.ndarray,
    lengths: np.ndarray,
    destination_starts: np.ndarray,
    size: int,
    workers: int = 1,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """Return a new array of ``size`` items where segment ``i`` copies ``lengths[i]`` items of
    ``sources[segment_sources[i]]`` from ``source_starts[i]`` to ``destination_starts[i]``.

    Segments should come sorted by source, then start (that is what makes the copy fast) and must not
    overlap in the destination; items no segment covers are left uninitialised. The sources are 1-D
    arrays of one fixed-width dtype; they are copied as bytes, so one compiled loop serves ints,
    floats and timestamps alike. The segments are split into ``workers``
    blocks of about equal token counts, copied in parallel. ``out`` (``size`` items of the sources'
    width) receives the copy instead of a new array, for a caller that allocates it elsewhere.
    """
    segment_sources, source_starts, lengths, destination_starts = (
        np.ascontiguousarray(array, dtype=np.int64)
        for array in (segment_sources, source_starts, lengths, destination_starts)
    )
    _check_bounds(sources, (segment_sources, source_starts, lengths, destination_starts), size)
    dtype = sources[0].dtype if sources else np.dtype(np.uint8)
    sources = [np.ascontiguousarray(source) for source in sources]
    if out is not None and (out.nbytes != size * dtype.itemsize or not out.flags.writeable or not out.flags.c_contiguous):
        raise ValueError(f"out must be a writable, contiguous array of {size} items of {dtype.itemsize} bytes.")
    destination = np.empty(size, dtype=dtype) if out is None else out.view(dtype)
    cumulative = np.cumsum(lengths)
    targets = np.linspace(0, cumulative[-1] if len(lengths) else 0, max(workers, 1) + 1)[1:-1]
    cuts = [0, *np.searchsorted(cumulative, targets).tolist(), len(lengths)]
    blocks = [(first, last) for first, last in pairwise(cuts) if last > first]

    def copy_block(block: tuple[int, int]) -> None:
        first, last = block
        changes = np.flatnonzero(np.diff(segment_sources[first:last])) + first + 1
        for start, stop in pairwise([first, *changes.tolist(), last]):
            piece = slice(start, stop)
            source = sources[segment_sources[start]]
            _scatter(
                source.ctypes.data,
                destination.ctypes.data,
                dtype.itemsize,
                source_starts[piece],
                lengths[piece],
                destination_starts[piece],
            )

    if len(blocks) <= 1:
        for block in blocks:
            copy_block(block)
    else:
        with ThreadPoolExecutor(len(blocks)) as pool:
            list(pool.map(copy_block, blocks))
    return destination


def _check_bounds(sources: Sequence[np.ndarray], segments: tuple[np.ndarray, ...], size: int) -> None:
    """Refuse segments outside their source or the destination: the compiled loop does not check bounds."""
    segment_sources, source_starts, lengths, destination_starts = segments
    if len({source.dtype for source in sources}) > 1:
        raise ValueError(f"sources must share one dtype, got {sorted({str(source.dtype) for source in sources})}.")
    if not len(lengths):
        return
    if segment_sources.min() < 0 or segment_sources.max() >= len(sources):
        raise ValueError(f"segment_sources must index the {len(sources)} sources.")
    source_sizes = np.array([len(source) for source in sources], dtype=np.int64)[segment_sources]
    inside = (
        (lengths >= 0)
        & (source_starts >= 0)
        & (source_starts + lengths <= source_sizes)
        & (destination_starts >= 0)
        & (destination_starts + lengths <= size)
    )
    if not inside.all():
        bad = int(np.flatnonzero(~inside)[0])
        raise ValueError(
            f"segment {bad} (source {segment_sources[bad]} of {source_sizes[bad]} items, start {source_starts[bad]}, "
            f"length {lengths[bad]}, destination {destination_starts[bad]} of {size}) is out of bounds."
        )
