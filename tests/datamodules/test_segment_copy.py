"""copy_segments: every segment lands where it was sent, for any fixed-width dtype, source and split."""

from __future__ import annotations

import subprocess
import sys

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
    sources = [rng.integers(-100, 100, size=size).astype(dtype) for size in (5000, 3000)]
    segments = [random_segments(rng, len(source), 100) for source in sources]
    segment_sources = np.repeat([0, 1], 100)
    starts = np.concatenate([segment[0] for segment in segments])
    lengths = np.concatenate([segment[1] for segment in segments])
    destination_starts = np.concatenate([segments[0][2], segments[1][2] + segments[0][1].sum()])
    copied = copy_segments(sources, segment_sources, starts, lengths, destination_starts, int(lengths.sum()), workers)
    assert copied.dtype == np.dtype(dtype)
    expected = np.empty_like(copied)
    for source, start, length, to in zip(segment_sources, starts, lengths, destination_starts):
        expected[to : to + length] = sources[source][start : start + length]
    np.testing.assert_array_equal(copied, expected)


def test_no_segments_and_empty_segments() -> None:
    source = np.arange(10, dtype=np.int32)
    assert copy_segments([source], [], [], [], [], 0, workers=2).size == 0
    copied = copy_segments([source], [0, 0, 0], [2, 5, 9], [3, 0, 1], [1, 4, 0], 4, workers=4)
    np.testing.assert_array_equal(copied, [9, 2, 3, 4])


def test_segments_out_of_bounds_are_refused() -> None:
    source = np.arange(5, dtype=np.int32)
    for start, length, to in ((4, 3, 0), (-1, 1, 0), (0, 2, 2), (0, -1, 0)):
        with pytest.raises(ValueError, match="segment 0 .* is out of bounds"):
            copy_segments([source], [0], [start], [length], [to], 3)
    with pytest.raises(ValueError, match="segment_sources must index the 1 sources"):
        copy_segments([source], [1], [0], [1], [0], 1)
    with pytest.raises(ValueError, match="sources must share one dtype"):
        copy_segments([source, source.astype(np.int64)], [0], [0], [1], [0], 1)


def test_a_missing_llvmlite_is_raised_by_the_packing_call_not_lost_in_the_compile_thread() -> None:
    code = (
        "import sys; sys.modules['llvmlite'] = None\n"
        "import pyarrow as pa\n"
        "from lit_memtrain.datamodules.table_packing import pack_table\n"
        "table = pa.table({'input_ids': pa.array([[1, 2, 3], [4, 5]])})\n"
        "try:\n"
        "    pack_table(table, 4, 'bfd')\n"
        "except ImportError as error:\n"
        "    print('raised', error)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.startswith("raised"), result.stdout
    assert "Traceback" not in result.stderr, result.stderr


def test_copy_preparation_compiles_and_writes_only_one_byte_per_page_until_finished(monkeypatch) -> None:
    import mmap

    from lit_memtrain.datamodules import segment_copy

    monkeypatch.setattr(segment_copy, "_PIECE_BYTES", 16 * mmap.PAGESIZE)
    destination = np.ones(64 * mmap.PAGESIZE + 100, dtype=np.uint8)
    preparation = segment_copy.CopyPreparation([destination])
    assert segment_copy._compiled  # the loop is ready when the constructor returns
    preparation._thread.join()  # let it touch every page
    preparation.finish()
    page_starts = np.arange(destination.size) % mmap.PAGESIZE == 0
    assert (destination[page_starts] == 0).all() and (destination[~page_starts] == 1).all()

    destination[:] = 1
    stopped = segment_copy.CopyPreparation([destination])
    stopped.finish()
    after_finish = destination.copy()
    stopped._thread.join(timeout=1)
    np.testing.assert_array_equal(destination, after_finish)  # nothing is written once finish() returns
    assert (destination[~page_starts] == 1).all()
