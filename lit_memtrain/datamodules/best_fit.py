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
that no open row fits open ``ceil(k / (capacity // s))`` rows at once. Python (numpy for the
blocks) then takes one step per (size, queue) meeting: each step either empties a queue or is the
last of its size, and a size ``s`` empties only queues in ``[s, previous size)`` or the few that
earlier sizes left above, so the steps number O(distinct sizes + min(capacity, rows)), a few
thousand for a million items, independent of the item count. Plain numpy means nothing to compile:
the first call in a process is as fast as the next (a numba version paid ~0.8 s of numba start-up
per process, more than the whole pack), and the plan is exactly the per-item one.

Why Best-Fit Decreasing: it never uses more than 11/9 of the optimal number of rows (plus a
constant), and rows that are almost full waste almost no compute on padding.

Usage::

    order, row_offsets = best_fit_decreasing(np.array([5, 3, 2]), capacity=5)  # rows [0], [1, 2]
"""

from __future__ import annotations

from collections import defaultdict, deque

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

    ``queues[f]`` holds the open rows with ``f`` tokens free, in arrival order, as blocks of row ids
    (``taken[f]`` of its first block are already gone); ``has_open`` marks the non-empty queues so that
    the best fit for size ``s`` is the first mark at or after ``s``.
    """
    queues: defaultdict[int, deque[np.ndarray]] = defaultdict(deque)
    taken = [0] * (capacity + 1)
    queued = [0] * (capacity + 1)
    has_open = np.zeros(capacity + 1, dtype=bool)
    steps: list[tuple[np.ndarray, int, int]] = []  # (rows, items per row, items placed), in placement order
    num_rows = 0

    def enqueue(free: int, rows: np.ndarray) -> None:
        if free and len(rows):
            queues[free].append(rows)
            queued[free] += len(rows)
            has_open[free] = True

    def dequeue(free: int, count: int) -> np.ndarray:
        blocks, start = queues[free], taken[free]
        queued[free] -= count
        has_open[free] = queued[free] > 0
        pieces = []
        while count:
            block = blocks[0]
            piece = block[start : start + count]
            pieces.append(piece)
            count -= len(piece)
            start += len(piece)
            if start == len(block):
                blocks.popleft()
                start = 0
        taken[free] = start
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    for size in np.flatnonzero(counts)[::-1].tolist():
        left = int(counts[size])
        while left:
            free = size + int(has_open[size:].argmax())
            if has_open[free]:
                per_row = free // size
                rows = dequeue(free, min(queued[free], -(-left // per_row)))
            else:
                free, per_row = capacity, capacity // size
                new_rows = -(-left // per_row)
                rows = np.arange(num_rows, num_rows + new_rows, dtype=np.int64)
                num_rows += new_rows
            placed = min(left, len(rows) * per_row)
            steps.append((rows, per_row, placed))
            left -= placed
            full = placed // per_row
            enqueue(free - per_row * size, rows[:full])
            if full < len(rows):  # the last row took fewer items: it keeps more free space
                enqueue(free - (placed - full * per_row) * size, rows[full:])
    return _rows_of_items(steps), num_rows


def _rows_of_items(steps: list[tuple[np.ndarray, int, int]]) -> np.ndarray:
    """The row of each item: in each step every row takes ``per_row`` items in turn, the last one the rest."""
    if not steps:
        return np.zeros(0, dtype=np.int64)
    rows = np.concatenate([step[0] for step in steps])
    num_step_rows = np.array([len(step[0]) for step in steps])
    per_row = np.array([step[1] for step in steps])
    placed = np.array([step[2] for step in steps])
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
