"""The length search on peak curves of the shapes a simulation produces (no simulation: fast)."""

from __future__ import annotations

import pytest

from lit_memtrain.planner.search import find_max_length, tolerance

GIB = 2**30
CURVES = {
    "affine": lambda length: 30 * GIB + 60_000 * length,
    "max of affine pieces": lambda length: max(40 * GIB, 10 * GIB + 90_000 * length, 5 * GIB + 120_000 * length),
    "quadratic": lambda length: 20 * GIB + 30_000 * length + int(0.02 * length * length),
    "nearly flat": lambda length: 70 * GIB + 10 * length,
}


def _longest_by_brute_force(curve, usable: int, ceiling: int) -> int:
    fitting = [length for length in range(1024, ceiling + 1, 1024) if curve(length) <= usable]
    return max(fitting, default=0)


@pytest.mark.parametrize("name", list(CURVES))
@pytest.mark.parametrize("usable_gib", [35, 60, 75, 200])
def test_finds_the_longest_length_to_within_one_percent(name, usable_gib):
    curve, calls, usable = CURVES[name], [], usable_gib * GIB
    search = find_max_length(lambda length: calls.append(length) or curve(length), usable, ceiling=2**22)
    longest = _longest_by_brute_force(curve, usable, 2**22)
    assert len(calls) == len(set(calls)) <= 8  # each length simulated once, a handful of them
    assert all(length % 1024 == 0 for length in calls)
    assert search.peaks == {length: curve(length) for length in calls}
    if search.reached_ceiling:
        assert search.max_length == longest == 2**22 and search.too_long is None
        return
    assert search.too_long is not None and curve(search.too_long) > usable  # confirmed not to fit
    assert search.max_length <= longest < search.too_long
    if longest:
        assert curve(search.max_length) <= usable
        assert search.too_long - search.max_length <= max(1024, 0.01 * search.max_length)
    else:
        assert search.max_length == 0 and search.too_long == 1024


def test_an_affine_peak_takes_a_guess_and_a_confirmation_after_the_configured_length():
    """With the step's fixed bytes as the line's start, the first guess of an affine peak is right."""
    curve, calls = CURVES["affine"], []
    search = find_max_length(lambda length: calls.append(length) or curve(length), 60 * GIB, start=98304,
                             fixed=30 * GIB)  # fmt: skip
    assert calls == [98304, search.max_length, search.too_long]
    assert search.too_long - search.max_length == tolerance(search.max_length) == 5120
    assert search.max_length <= _longest_by_brute_force(curve, 60 * GIB, 2**22) < search.too_long
    assert curve(search.max_length) <= 60 * GIB < curve(search.too_long)


def test_tolerance_is_one_percent_in_whole_multiples_of_1024_and_at_least_1024():
    assert [tolerance(length) for length in (1024, 65536, 131072, 524288, 1048576)] == [1024, 1024, 1024, 5120, 10240]


def test_stops_at_the_ceiling_and_says_so():
    search = find_max_length(lambda length: length, usable=2**40, ceiling=2**20)
    assert search.max_length == 2**20
    assert search.reached_ceiling and search.too_long is None


def test_nothing_fits_gives_zero():
    calls = []
    search = find_max_length(lambda length: calls.append(length) or 100 * GIB, usable=80 * GIB)
    assert search.max_length == 0 and search.too_long == 1024
    assert calls[-1] == 1024 and len(calls) <= 4


def test_longer_for_more_memory():
    curve = CURVES["max of affine pieces"]
    lengths = [find_max_length(curve, gib * GIB).max_length for gib in (40, 50, 60, 70, 80, 120)]
    assert lengths == sorted(lengths) and lengths[0] < lengths[-1]
