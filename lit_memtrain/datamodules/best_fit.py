"""Best-Fit Decreasing bin packing of item sizes into rows of a fixed capacity, one size at a time.

Items are taken longest first (a stable sort, so equal sizes keep their order), and each goes to
the open row with the least free space that still fits it, or opens a new row; rows with the same
free space queue first in, first out, which makes the result deterministic.

Why per size and not per item: sizes are integers in ``[1, capacity]``, so the items come in at most
``capacity`` distinct sizes, and the items of one size move open rows in blocks. Placing ``k`` items
of size ``s``: the best-fitting rows are those with the least free space ``f >= s``; the first of them
takes ``f // s`` items in a row (after each it is still the best fit, every free space in
``[s, f)`` being empty) and ends with ``f % s`` free, then the next row of that queue does the same.
So the rows of one queue move together, in queue order, to the queue of ``f % s``, and the items
that no open row fits open ``ceil(k / (capacity // s))`` rows at once. Plain Python (rows as ranges of
ids) then takes one step per (size, queue) meeting: each step either empties a queue or is the
last of its size, and a size ``s`` empties only queues in ``[s, previous size)`` or the few that
earlier sizes left above, so the steps number O(distinct sizes + min(capacity, rows)), a few
thousand for a million items, independent of the item count; numpy expands the steps into a row per
item at the end. Nothing to compile:
the first call in a process is as fast as the next (a numba version paid ~0.8 s of numba start-up
per process, more than the whole pack), and the plan is exactly the per-item one.

Why Best-Fit Decreasing: it never uses more than 11/9 of the optimal number of rows (plus a
constant), and rows that are almost full waste almost no compute on padding.

Usage::

    order, row_offsets = best_fit_decreasing(np.array([5, 3, 2]), capacity=5)  # rows [0], [1, 2]
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections import deque

import numpy as np


def best_fit_decreasing(sizes: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """Best-Fit Decreasing of ``sizes`` (each in ``[1, capacity]``) into rows of ``capacity``.

    Returns ``(order, row_offsets)``: item indices in output order (rows in the order they were
    opened, items within a row in the order they were placed) and where each row starts.
    """
    sizes = np.asarray(sizes)
    if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)) or capacity < 1:
        raise ValueError(f"capacity must be an integer >= 1, got {capacity!r}.")
    if sizes.ndim != 1 or not (np.issubdtype(sizes.dtype, np.integer) or sizes.size == 0):
        raise ValueError(f"sizes must be a 1-D array of integers, got shape {sizes.shape} and dtype {sizes.dtype}.")
    sizes = sizes.astype(np.int64)
    if sizes.size and not 1 <= sizes.min() <= sizes.max() <= capacity:
        raise ValueError(
            f"every size must be in [1, capacity={capacity}], found sizes from {sizes.min()} to {sizes.max()}; "
            "drop empty items and cut or truncate the long ones first."
        )
    capacity = int(capacity)
    by_size = _stable_argsort(capacity - sizes, capacity)
    item_row, num_rows = _place_by_size(np.bincount(sizes, minlength=capacity + 1), capacity)
    row_offsets = np.zeros(num_rows + 1, dtype=np.int64)
    np.cumsum(np.bincount(item_row, minlength=num_rows), out=row_offsets[1:])
    return by_size[np.argsort(item_row, kind="stable")], row_offsets  # timsort: item_row has long runs


def _place_by_size(counts: np.ndarray, capacity: int) -> tuple[np.ndarray, int]:
    """The row of each item, items taken longest first (``counts[s]`` items of size ``s``), and the row count.

    ``queues[f]`` holds the open rows with ``f`` tokens free, in arrival order, as ``[start, stop)`` ranges of
    row ids (rows are opened in blocks of consecutive ids and move in blocks, so a few ranges describe
    thousands of rows), flat: start, stop, start, stop, ...; ``open_frees`` lists the free spaces whose queue
    is not empty, sorted, so that the best fit for size ``s`` is the first entry ``>= s``. Plain Python ints
    in flat lists and deques: a step costs about a microsecond, where numpy calls on tiny arrays cost several,
    and nothing the loop keeps is a tuple or list the garbage collector tracks (with ~35,000 of those alive,
    the collector ran ~50 times per plan, and a full collection of a process holding torch and
    transformers takes 0.2-0.3 s here, longer than the whole pack).
    """
    queues: dict[int, deque[int]] = {}
    queued: dict[int, int] = {}
    open_frees: list[int] = []
    ranges: list[int] = []  # the row ranges of every step, in step order, flat
    step_rows: list[int] = []
    step_per_row: list[int] = []
    step_placed: list[int] = []
    num_rows = 0

    def enqueue(free: int, row_ranges: list[int], count: int) -> None:
        if free and count:
            if free not in queues:
                insort(open_frees, free)
                queues[free], queued[free] = deque(), 0
            queues[free].extend(row_ranges)
            queued[free] += count

    def dequeue(free: int, count: int) -> None:
        """Move the first ``count`` rows of ``queues[free]`` to the end of ``ranges``."""
        blocks = queues[free]
        queued[free] -= count
        if not queued[free]:
            del open_frees[bisect_left(open_frees, free)], queues[free], queued[free]
        while count:
            start, stop = blocks.popleft(), blocks.popleft()
            if stop - start > count:
                blocks.appendleft(stop)
                blocks.appendleft(start + count)
                stop = start + count
            ranges.append(start)
            ranges.append(stop)
            count -= stop - start

    for size in np.flatnonzero(counts)[::-1].tolist():
        left = int(counts[size])
        while left:
            first = len(ranges)
            best = bisect_left(open_frees, size)
            if best < len(open_frees):
                free = open_frees[best]
                per_row = free // size
                rows = min(queued[free], -(-left // per_row))
                dequeue(free, rows)
            else:
                free, per_row = capacity, capacity // size
                rows = -(-left // per_row)
                ranges.append(num_rows)
                ranges.append(num_rows + rows)
                num_rows += rows
            placed = min(left, rows * per_row)
            step_rows.append(rows)
            step_per_row.append(per_row)
            step_placed.append(placed)
            left -= placed
            full = placed // per_row
            if full == rows:
                enqueue(free - per_row * size, ranges[first:], rows)
            else:  # the last row took fewer items: it keeps more free space
                start, stop = ranges[-2], ranges[-1]
                full_ranges = ranges[first:-2] + ([start, stop - 1] if stop - 1 > start else [])
                enqueue(free - per_row * size, full_ranges, full)
                enqueue(free - (placed - full * per_row) * size, [stop - 1, stop], 1)
    return _rows_of_items(ranges, step_rows, step_per_row, step_placed), num_rows


def _rows_of_items(ranges: list[int], step_rows: list[int], step_per_row: list[int], step_placed: list[int]) -> np.ndarray:
    """The row of each item: in each step every row takes ``per_row`` items in turn, the last one the rest."""
    if not step_rows:
        return np.zeros(0, dtype=np.int64)
    row_ranges = np.array(ranges, dtype=np.int64).reshape(-1, 2)
    range_rows = row_ranges[:, 1] - row_ranges[:, 0]
    rows = np.repeat(row_ranges[:, 0] - np.cumsum(range_rows) + range_rows, range_rows) + np.arange(int(range_rows.sum()))
    num_step_rows, per_row, placed = (np.array(values, dtype=np.int64) for values in (step_rows, step_per_row, step_placed))
    items_per_row = np.repeat(per_row, num_step_rows)
    items_per_row[np.cumsum(num_step_rows) - 1] = placed - (num_step_rows - 1) * per_row
    return np.repeat(rows, items_per_row)


def _stable_argsort(values: np.ndarray, bound: int) -> np.ndarray:
    """Stable argsort of values in ``[0, bound]``: numpy radix-sorts 16-bit integers in O(n), so values
    below 2**32 are sorted by their low 16 bits, then (stably) by their high 16 bits."""
    if bound <= 0xFFFF:
        return np.argsort(values.astype(np.uint16), kind="stable")
    if bound <= 0xFFFF_FFFF:
        order = np.argsort((values & 0xFFFF).astype(np.uint16), kind="stable")
        return order[np.argsort((values[order] >> 16).astype(np.uint16), kind="stable")]
    return np.argsort(values, kind="stable")
