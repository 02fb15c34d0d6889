"""profile_lengths: every figure checked against hand counts on a small set of lengths."""

from __future__ import annotations

import matplotlib
import numpy as np
import pytest
from matplotlib.image import imread

from lit_memtrain.datamodules.length_profile import (
    CandidateProfile,
    profile_lengths,
    recommend_max_length,
    write_histogram,
)


def test_figures_match_hand_counts() -> None:
    # Lengths 1, 2, 3, 10 (16 tokens); batches of 2 in dataset order: [1, 2] and [3, 10].
    report = profile_lengths(np.array([1, 2, 3, 10]), candidates=[16, 4, 8], batch_size=2)
    assert report.num_examples == 4 and report.num_tokens == 16
    by_length = {candidate.max_length: candidate for candidate in report.candidates}
    assert list(by_length) == [4, 8, 16]

    four = by_length[4]  # kept 1+2+3+4 = 10 tokens
    assert four.truncated_token_share == pytest.approx(6 / 16)
    assert four.truncated_example_share == pytest.approx(1 / 4)
    assert four.batch_padding_waste == pytest.approx(1 - 10 / (2 * 2 + 2 * 4))
    assert four.max_length_padding_waste == pytest.approx(1 - 10 / 16)
    assert four.packed_rows == 3  # [4], [3, 1], [2]
    assert four.packing_waste == pytest.approx(1 - 10 / 12)

    eight = by_length[8]  # kept 1+2+3+8 = 14 tokens
    assert eight.truncated_token_share == pytest.approx(2 / 16)
    assert eight.batch_padding_waste == pytest.approx(1 - 14 / (2 * 2 + 2 * 8))
    assert eight.max_length_padding_waste == pytest.approx(1 - 14 / 32)
    assert eight.packed_rows == 2  # [8], [3, 2, 1]
    assert eight.packing_waste == pytest.approx(1 - 14 / 16)

    sixteen = by_length[16]
    assert sixteen.truncated_token_share == 0 and sixteen.truncated_example_share == 0
    assert sixteen.batch_padding_waste == pytest.approx(1 - 16 / (2 * 2 + 2 * 10))
    assert sixteen.max_length_padding_waste == pytest.approx(1 - 16 / 64)
    assert sixteen.packed_rows == 1 and sixteen.packing_waste == 0

    assert report.recommended_max_length == 16
    relaxed = profile_lengths(np.array([1, 2, 3, 10]), [4, 8, 16], 2, max_truncated_token_share=0.2)
    assert relaxed.recommended_max_length == 8


def test_last_partial_batch_and_empty_examples() -> None:
    report = profile_lengths(np.array([4, 0, 2, 6, 1]), candidates=[8], batch_size=2)
    (candidate,) = report.candidates
    # Batches [4, 0] -> 2 x 4 slots, [2, 6] -> 2 x 6, [1] -> 1 x 1: 21 slots for 13 tokens.
    assert candidate.batch_padding_waste == pytest.approx(1 - 13 / 21)
    assert candidate.max_length_padding_waste == pytest.approx(1 - 13 / 40)
    assert candidate.packed_rows == 2  # [6, 2], [4, 1]; the empty example takes no row


def test_percentiles_and_default_candidates() -> None:
    report = profile_lengths(np.arange(1, 101))
    assert report.percentiles == pytest.approx(
        {"p50": 50.5, "p90": 90.1, "p95": 95.05, "p99": 99.01, "max": 100}
    )
    assert [candidate.max_length for candidate in report.candidates] == [32, 64, 128]
    lognormal = np.clip(np.random.default_rng(0).lognormal(np.log(300), 1.0, 2000), 1, 5000)
    report = profile_lengths(lognormal.astype(np.int64))
    assert [c.max_length for c in report.candidates] == [256, 512, 1024, 2048, 4096, 8192]


def test_recommendation_rule() -> None:
    def candidate(max_length: int, truncated: float) -> CandidateProfile:
        return CandidateProfile(max_length, truncated, 0.0, 0.0, 0.0, 0.0, 1)

    candidates = [candidate(4096, 0.001), candidate(1024, 0.2), candidate(2048, 0.01)]
    assert recommend_max_length(candidates) == 2048
    assert recommend_max_length(candidates, max_truncated_token_share=0.005) == 4096
    assert recommend_max_length([candidate(512, 0.5), candidate(256, 0.7)]) == 512


def test_table_marks_the_recommended_row() -> None:
    table = profile_lengths(np.array([1, 2, 3, 10]), candidates=[4, 8, 16], batch_size=2).to_table()
    lines = table.splitlines()
    assert lines[0] == "4 examples, 16 tokens; lengths: p50 2.5, p90 7.9, p95 8.95, p99 9.79, max 10"
    marked = [line for line in lines if line.lstrip().startswith("*")]
    assert [line.split()[:3] for line in marked] == [["*", "16", "0.00%"], ["*", "recommended:", "the"]]
    row_of_four = next(line for line in lines[1:] if line.split()[:1] == ["4"])
    assert row_of_four.split() == ["4", "37.50%", "25.00%", "16.67%", "37.50%", "16.67%", "3"]


def test_histogram_png(tmp_path) -> None:
    backend = matplotlib.get_backend()
    lengths = np.random.default_rng(1).integers(1, 3000, 500)
    path = write_histogram(profile_lengths(lengths, [1024, 4096]), tmp_path / "lengths.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert imread(path).shape[:2] == (450, 800)
    from_lengths = write_histogram(lengths, tmp_path / "raw.png")
    assert from_lengths.stat().st_size > 1000
    assert matplotlib.get_backend() == backend


def test_errors_are_clear() -> None:
    with pytest.raises(ValueError, match="non-empty 1-D array of integer token counts"):
        profile_lengths(np.array([], dtype=np.int64))
    with pytest.raises(ValueError, match="non-empty 1-D array of integer token counts"):
        profile_lengths(np.array([1.5, 2.0]))
    with pytest.raises(ValueError, match="lengths must be >= 0, found -3"):
        profile_lengths(np.array([4, -3]))
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1, got 0"):
        profile_lengths(np.array([4]), batch_size=0)
    with pytest.raises(ValueError, match="candidates must be a non-empty list of integers >= 1"):
        profile_lengths(np.array([4]), candidates=[512, 0])
    with pytest.raises(ValueError, match="candidates must be a non-empty list of integers >= 1"):
        profile_lengths(np.array([4]), candidates=[])
    with pytest.raises(ValueError, match="max_truncated_token_share must be in \\[0, 1\\)"):
        profile_lengths(np.array([4]), max_truncated_token_share=1.5)
