"""The longest sequence that fits, and which technique to add when a configuration does not fit.

Why a bracketing search guided by interpolation and not plain bisection: every evaluation is a whole
simulated step, seconds to tens of seconds for a large model. With an O(L) attention kernel each part of
a step's memory grows linearly with the sequence (saved inputs, logits or loss chunks, tiles of fixed
size), so the peak is close to ``a + b * L`` and the secant through two simulated lengths lands within a
few thousand tokens of the answer. The search keeps a bracket (the longest length known to fit, the
shortest known not to), tries the interpolated length rounded down to 1,024 tokens and the next multiple,
and bisects when interpolation stops shrinking the bracket, so it always ends at a length that fits with
the next multiple of 1,024 not fitting. A search typically simulates 4 to 6 lengths.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["LengthSearch", "find_max_length"]

GRANULARITY = 1024
CEILING = 2**24


@dataclass
class LengthSearch:
    """The simulated peaks by length, and the result: the longest multiple of ``granularity`` that fits."""

    peaks: dict[int, int] = field(default_factory=dict)
    max_length: int = 0
    reached_ceiling: bool = False


def _round_down(length: float, granularity: int) -> int:
    return int(length // granularity) * granularity


def _crossing(a: tuple[int, int], b: tuple[int, int], usable: int) -> float | None:
    """Where the line through two (length, peak) points reaches ``usable``; None if it does not rise."""
    (l0, p0), (l1, p1) = sorted((a, b))
    if p1 <= p0 or l1 == l0:
        return None
    return l0 + (usable - p0) * (l1 - l0) / (p1 - p0)


def find_max_length(
    peak_at: Callable[[int], int],
    usable: int,
    start: int = 65536,
    granularity: int = GRANULARITY,
    ceiling: int = CEILING,
) -> LengthSearch:
    """The longest multiple of ``granularity`` (up to ``ceiling``) whose simulated peak is at most ``usable``.

    ``peak_at(length)`` simulates a step and returns its device peak; ``start`` is the first length tried
    after ``granularity`` itself. ``max_length`` is 0 when not even ``granularity`` tokens fit.
    """
    search = LengthSearch()

    def fits(length: int) -> bool:
        if length not in search.peaks:
            search.peaks[length] = peak_at(length)
        return search.peaks[length] <= usable

    if not fits(granularity):
        return search
    low, high = granularity, None
    candidate = min(max(_round_down(start, granularity), 2 * granularity), ceiling)
    while high is None or high - low > granularity:
        if fits(candidate):
            low = candidate
        else:
            high = candidate
        if low >= ceiling:
            search.reached_ceiling = True
            break
        candidate = _next_candidate(search.peaks, low, high, usable, granularity, ceiling)
    search.max_length = low
    return search


def _next_candidate(
    peaks: dict[int, int], low: int, high: int | None, usable: int, granularity: int, ceiling: int
) -> int:
    if high is None:
        below = max(length for length in peaks if length < low) if len(peaks) > 1 else None
        estimate = _crossing((below, peaks[below]), (low, peaks[low]), usable) if below is not None else None
        guess = _round_down(estimate, granularity) if estimate is not None else 2 * low
        return min(max(guess, low + granularity), 4 * low, ceiling)
    estimate = _crossing((low, peaks[low]), (high, peaks[high]), usable)
    guess = _round_down(estimate, granularity) if estimate is not None else low
    if guess in peaks and guess + granularity not in peaks:
        guess += granularity  # the interpolated length is known to fit: try the next one up
    if not low < guess < high or guess in peaks:
        guess = _round_down((low + high) // 2, granularity)
    return guess if low < guess < high else low + granularity
