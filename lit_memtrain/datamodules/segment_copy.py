"""Copy many slices of token buffers into one new buffer, reading the sources in order.

Why: packing a million examples copies about a million slices of ~500 tokens each, scattered over
gigabytes. Gathering them in output order reads the source at random, and each read of a new page
stalls the core on a TLB miss (worse under a VM's nested page tables), so a gather runs at a fraction
of memory bandwidth (Arrow's list-view flatten, which gathers, took about twice as long). Visiting the
slices in source order reads the source sequentially and scatters the writes instead, which the CPU
buffers without stalling. A dataset column is usually stored as many Arrow chunks, each with its own
buffer: the sources are read where they are (memory-mapped or not), never concatenated.

The loop is one ``memcpy`` per slice between byte addresses, so it serves every fixed-width dtype. It
is a dozen lines of LLVM IR, compiled by llvmlite in a few milliseconds the first time it is needed in
a process and called through ctypes, which releases the GIL: one thread per core copies its own share
of the slices. (A Python loop per slice would cost more than the copy; numba compiled the same loop,
but its start-up, ~0.8 s in each new process, was longer than the whole pack; numpy's fancy indexing
over strided windows, one size of slice at a time, was 2-3x slower than ``memcpy``; the kernel's
``process_vm_readv`` on the process itself, which needs nothing compiled, 2x slower.) Bounds are checked
in Python before the loop runs. :class:`CopyPreparation` compiles the loop and maps the destination's
fresh pages on another core while the caller makes its plan.

Usage::

    out = copy_segments([values], np.zeros(3), source_starts, lengths, destination_starts, size=12, workers=2)
"""

from __future__ import annotations

import ctypes
import mmap
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from itertools import pairwise

import numpy as np

# scatter(source, destination, width, source_starts, lengths, destination_starts, count): for each i < count,
# memcpy(destination + destination_starts[i] * width, source + source_starts[i] * width, lengths[i] * width).
_SCATTER_IR = """
declare void @llvm.memcpy.p0.p0.i64(ptr, ptr, i64, i1)

define void @scatter(i64 %source, i64 %destination, i64 %width, ptr %source_starts, ptr %lengths,
                     ptr %destination_starts, i64 %count) {
entry:
  %none = icmp sle i64 %count, 0
  br i1 %none, label %done, label %loop
loop:
  %i = phi i64 [ 0, %entry ], [ %next, %loop ]
  %source_start_at = getelementptr i64, ptr %source_starts, i64 %i
  %source_start = load i64, ptr %source_start_at
  %length_at = getelementptr i64, ptr %lengths, i64 %i
  %length = load i64, ptr %length_at
  %destination_start_at = getelementptr i64, ptr %destination_starts, i64 %i
  %destination_start = load i64, ptr %destination_start_at
  %from_offset = mul i64 %source_start, %width
  %to_offset = mul i64 %destination_start, %width
  %bytes = mul i64 %length, %width
  %from_address = add i64 %source, %from_offset
  %to_address = add i64 %destination, %to_offset
  %from = inttoptr i64 %from_address to ptr
  %to = inttoptr i64 %to_address to ptr
  call void @llvm.memcpy.p0.p0.i64(ptr %to, ptr %from, i64 %bytes, i1 false)
  %next = add i64 %i, 1
  %more = icmp slt i64 %next, %count
  br i1 %more, label %loop, label %done
done:
  ret void
}
"""
_compile_lock = threading.Lock()
_PIECE_BYTES = 64 * 2**20  # pages touched per GIL release: a few ms of page faults, the most finish() waits
_compiled: list = []  # [execution engine (owns the machine code), ctypes function], once compiled


def _scatter() -> Callable[..., None]:
    """The compiled loop (compiled on first use; the engine that owns its code lives as long as the process)."""
    with _compile_lock:
        if not _compiled:
            import llvmlite.binding as llvm

            llvm.initialize_native_target()
            llvm.initialize_native_asmprinter()
            module = llvm.parse_assembly(_SCATTER_IR)
            module.verify()
            engine = llvm.create_mcjit_compiler(module, llvm.Target.from_default_triple().create_target_machine(opt=2))
            engine.finalize_object()
            signature = ctypes.CFUNCTYPE(None, *[ctypes.c_int64] * 3, *[ctypes.c_void_p] * 3, ctypes.c_int64)
            _compiled.extend([engine, signature(engine.get_function_address("scatter"))])
        return _compiled[1]


class CopyPreparation:
    """Compile the copy loop, and map the destinations' fresh pages on another core meanwhile and while the
    caller goes on (with the packing plan), until :meth:`finish`.

    Why: a first copy in a process pays twice over for what a later one gets for free. llvmlite is imported
    and the loop compiled (~40 ms), and the destination is fresh memory: the kernel maps and zeroes each
    page on its first write, which made a first copy of 850 MB take ~150 ms instead of ~90 ms here. Neither
    needs the plan. A thread writes one byte per page, a piece at a time (numpy releases the GIL for each
    piece), while this thread compiles (Python, GIL-bound: llvmlite's import) and then makes the plan;
    the copy faults in whatever is left. Warm calls find the loop compiled and the pool's pages mapped: the
    thread then costs one write per page.

    Example:
        >>> preparation = CopyPreparation([destination])  # compiles; a thread maps the destination's pages
        >>> plan = make_plan()
        >>> preparation.finish()  # before the copy writes: the thread writes zeros
    """

    def __init__(self, destinations: Sequence[np.ndarray]) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._touch, args=(destinations,), daemon=True)
        self._thread.start()
        try:
            _scatter()
        except Exception:  # noqa: BLE001 - raised again by copy_segments, where the loop is needed
            pass

    def _touch(self, destinations: Sequence[np.ndarray]) -> None:
        for destination in destinations:
            pages = destination.reshape(-1).view(np.uint8)
            for start in range(0, pages.size, _PIECE_BYTES):
                if self._stop.is_set():
                    return
                pages[start : start + _PIECE_BYTES : mmap.PAGESIZE] = 0

    def finish(self) -> None:
        """Stop touching pages and wait for the thread (at most one piece): the destinations are the caller's."""
        self._stop.set()
        self._thread.join()


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
    scatter = _scatter()
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
            scatter(
                source.ctypes.data,
                destination.ctypes.data,
                dtype.itemsize,
                source_starts[piece].ctypes.data,
                lengths[piece].ctypes.data,
                destination_starts[piece].ctypes.data,
                stop - start,
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
