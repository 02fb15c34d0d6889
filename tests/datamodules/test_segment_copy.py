"""copy_segments: every segment lands where it was sent, for any fixed-width dtype and any split."""

from __future__ import annotations

import numpy as np
import pytest

from lit_memtrain.datamodules.segment_copy import copy_segments


def random_segments(rng: np.random.Generator, source_size: int, count: int) -> tuple[np.ndarray, ...]:
    """Non-overlapping source segments in source order, sent to a shuffled set of destinations."""
    cuts = np.sort(rng.choice(np.arange(1, source_size), size=2 * count, replace=False))
    starts, stops = cuts[0::2], cuts[1::2]
    lengths = stops - starts
    destination_order = rng.permutation(count)
    destination_starts = np.empty(count, dtype=np.int64)
    destination_starts[destination_order] = np.cumsum(lengths[destination_order]) - lengths[destination_order]
    return starts, lengths, destination_starts


@pytest.mark.parametrize("dtype", [np.int8, np.uint16, np.int32, np.int64, np.float16, np.float64])
@pytest.mark.parametrize("workers", [1, 3])
def test_each_segment_is_copied_to_its_destination(dtype: type, workers: int) -> None:
    rng = np.random.default_rng(0)
    source = rng.integers(-100, 100, size=5000).astype(dtype)
    starts, lengths, destination_starts = random_segments(rng, len(source), 200)
    copied = copy_segments(source, starts, lengths, destination_starts, int(lengths.sum()), workers)
    assert copied.dtype == source.dtype
    expected = np.empty_like(copied)
    for start, length, to in zip(starts, lengths, destination_starts):
        expected[to : to + length] = source[start : start + length]
    np.testing.assert_array_equal(copied, expected)


def test_no_segments_and_empty_segments() -> None:
    source = np.arange(10, dtype=np.int32)
    assert copy_segments(source, np.array([]), np.array([]), np.array([]), 0, workers=2).size == 0
    copied = copy_segments(source, np.array([2, 5, 9]), np.array([3, 0, 1]), np.array([1, 4, 0]), 4, workers=4)
    np.testing.assert_array_equal(copied, [9, 2, 3, 4])
