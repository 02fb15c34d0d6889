"""The length search on peak curves of the shapes a simulation produces (no simulation: fast)."""

from __future__ import annotations

import pytest

from lit_memtrain.planner.search import find_max_length

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
def test_finds_the_longest_multiple_of_1024_that_fits(name, usable_gib):
    curve, calls = CURVES[name], []
    search = find_max_length(lambda length: calls.append(length) or curve(length), usable_gib * GIB, ceiling=2**22)
    assert search.max_length == _longest_by_brute_force(curve, usable_gib * GIB, 2**22)
    assert len(calls) == len(set(calls)) <= 12  # each length simulated once, a handful of them
    assert all(length % 1024 == 0 for length in calls)


def test_stops_at_the_ceiling_and_says_so():
    search = find_max_length(lambda length: length, usable=2**40, ceiling=2**20)
    assert search.max_length == 2**20
    assert search.reached_ceiling


def test_nothing_fits_gives_zero_after_one_simulation():
    search = find_max_length(lambda length: 100 * GIB, usable=80 * GIB)
    assert search.max_length == 0
    assert list(search.peaks) == [1024]


def test_longer_for_more_memory():
    curve = CURVES["max of affine pieces"]
    lengths = [find_max_length(curve, gib * GIB).max_length for gib in (40, 50, 60, 70, 80, 120)]
    assert lengths == sorted(lengths) and lengths[0] < lengths[-1]
