"""Plan packed rows: which token slices of which examples make up each row of at most ``max_length`` tokens.

Why a plan apart from the copy: the plan needs only the examples' lengths (numpy, no Arrow), so the length
profiler sizes packed rows with it, and :mod:`~lit_memtrain.datamodules.table_packing` then copies every column
by the same plan. It is made once over the whole dataset by Best-Fit Decreasing one size class at a time
(:mod:`~lit_memtrain.datamodules.best_fit`), not per ``datasets.map`` batch as TRL does.

Strategies (the contract of ``trl.pack_dataset``):

- ``"bfd"``: Best-Fit Decreasing over whole examples; tokens past ``max_length`` in one example
  are dropped. Keeps conversations intact (the SFT default).
- ``"bfd_split"``: cut long examples into chunks of at most ``max_length`` tokens first, then
  Best-Fit Decreasing; no token is lost (Fewer Truncations Improve Language Modeling,
  arXiv 2404.10830).
- ``"wrapped"``: concatenate every example and cut blocks of ``max_length`` tokens; the last
  block keeps the remainder. Fast and full, but cuts examples anywhere.

The checks of ``max_length`` and of the strategy are public here: every packer (a table, a dataset, a stream)
refuses the same arguments with the same message.

Usage::

    plan = plan_packing(np.array([5, 3, 2]), max_length=5, strategy="bfd")  # rows [0], [1, 2]
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

__all__ = ["STRATEGIES", "PackingPlan", "check_max_length", "check_strategy", "plan_packing"]

STRATEGIES: tuple[str, ...] = ("bfd", "bfd_split", "wrapped")


def check_max_length(max_length: int) -> None:
    """Raise a ValueError unless ``max_length`` (tokens per row) is an integer >= 1 (numpy integers too)."""
    if isinstance(max_length, bool) or not isinstance(max_length, (int, np.integer)) or max_length < 1:
        raise ValueError(f"max_length must be an integer >= 1, got {max_length!r}.")


def check_strategy(strategy: str) -> None:
    """Raise a ValueError naming the choices unless ``strategy`` is one of :data:`STRATEGIES`."""
    if strategy not in STRATEGIES:
        raise ValueError(
            f"Unknown packing strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}."
        )


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
    check_max_length(max_length)
    check_strategy(strategy)
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
