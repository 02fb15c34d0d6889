"""The longest sequence that fits, to within 1% of its length, in as few simulated steps as it takes.

Why guess from a line: every evaluation is a simulated step (a second to tens of seconds for a large model). With
an O(L) attention kernel every part of a step's memory grows linearly with the sequence (saved inputs, tiles and
loss chunks of fixed size), so the peak is close to ``a + b * L``: two simulated lengths give a line, and where it
reaches the usable memory is a good guess of the longest length. The first line goes through the configured
length's peak and the memory a step holds whatever the length (parameters, gradients, optimizer state: the
simulation's ``fixed`` bytes), so the first simulation of a search is already a guess.

Why to within 1%: what a user decides with the answer (the ``max_length`` of a run, whether a GPU is large enough)
does not change with the last percent, and pinning the exact multiple of 1,024 tokens at a million tokens costs
several more simulations. The search keeps a bracket, the longest length known to fit and the shortest known not
to, and stops when they are at most ``max(1,024 tokens, 1% of the length)`` apart: the answer fits, and a length that
much longer is confirmed not to (1% at long lengths; below 102,400 tokens the 1,024 tokens are more, 25% at 4,096).
Each step simulates the line's guess, or, when the guess is that close to a length
already simulated, the length that would close the bracket from it (a confirmation). Inside the bracket the line
goes through its two ends (regula falsi), with the Illinois rule: when two guesses in a row land on the same side,
the far end counts half, so a curved peak does not leave one end stuck and the search still ends in a few steps.
Lengths are multiples of 1,024. An affine peak takes two or three simulations after the configured length's: the
first guess (from the ``fixed`` line, which misses by the part of the peak that neither grows with the length nor
is fixed), the line's guess through two simulated lengths, and its confirmation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["LengthSearch", "find_max_length", "tolerance"]

GRANULARITY = 1024
CEILING = 2**24
TOLERANCE = 0.01


@dataclass
class LengthSearch:
    """The simulated peaks by length, and the result.

    Attributes:
        peaks: the device peak of each simulated length.
        max_length: the longest simulated length that fits (a multiple of the granularity; 0 if none does).
        too_long: the shortest simulated length that does not fit (None if every one did): at most
            :func:`tolerance` above ``max_length``.
        reached_ceiling: the search stopped at its ceiling, which fits.
    """

    peaks: dict[int, int] = field(default_factory=dict)
    max_length: int = 0
    too_long: int | None = None
    reached_ceiling: bool = False


def tolerance(length: int, granularity: int = GRANULARITY, fraction: float = TOLERANCE) -> int:
    """How far above ``length`` the shortest length that does not fit may be: 1% of it, in whole multiples of
    ``granularity``, and at least one."""
    return max(granularity, int(fraction * length) // granularity * granularity)


def find_max_length(
    peak_at: Callable[[int], int],
    usable: int,
    start: int = 65536,
    granularity: int = GRANULARITY,
    ceiling: int = CEILING,
    fixed: int | None = None,
) -> LengthSearch:
    """The longest multiple of ``granularity`` (up to ``ceiling``) whose simulated peak is at most ``usable``, to
    within :func:`tolerance`: the next length simulated above it does not fit.

    ``peak_at(length)`` simulates a step and returns its device peak; ``start`` is the first length simulated (the
    configured one, usually simulated already); ``fixed`` is what the step holds at any length, if known (the line
    of the first guess starts there).
    """
    search = _Search(peak_at, usable, granularity, ceiling, fixed)
    search.simulate(min(max(_round_down(start, granularity), granularity), ceiling))
    while not search.done():
        search.simulate(search.next_length())
    return LengthSearch(search.peaks, search.low, search.high, search.low >= ceiling)


def _round_down(length: float, granularity: int) -> int:
    return int(length // granularity) * granularity


class _Search:
    """The bracket and how the next length is chosen.

    Inside the bracket the guess is the regula falsi's (where the line through its ends reaches ``usable``), with
    the Illinois rule: when two guesses in a row land on the same side, the other end's distance to ``usable``
    counts half, so a curved peak does not leave one end stuck far from the answer.
    """

    def __init__(
        self, peak_at: Callable[[int], int], usable: int, granularity: int, ceiling: int, fixed: int | None
    ) -> None:
        self.peak_at, self.usable, self.granularity, self.ceiling, self.fixed = (
            peak_at, usable, granularity, ceiling, fixed,
        )  # fmt: skip
        self.peaks: dict[int, int] = {}
        self.low, self.high = 0, None  # the longest length known to fit (0: none yet), the shortest known not to
        self.weights = {True: 1.0, False: 1.0}  # by side (fits or not): how much its end's distance counts
        self.last_fitted: bool | None = None

    def simulate(self, length: int) -> None:
        if length not in self.peaks:
            self.peaks[length] = self.peak_at(length)
        fitted = self.peaks[length] <= self.usable
        if fitted:
            self.low = max(self.low, length)
        else:
            self.high = length if self.high is None else min(self.high, length)
        if fitted == self.last_fitted:
            self.weights[not fitted] /= 2
        else:
            self.weights = {True: 1.0, False: 1.0}
        self.last_fitted = fitted

    def done(self) -> bool:
        low, high = self.low, self.high
        if low >= self.ceiling:
            return True
        if high is None:
            return False
        return high <= self.granularity or bool(low and high - low <= tolerance(low, self.granularity))

    def next_length(self) -> int:
        """Strictly inside the bracket, a multiple of the granularity: the guess, or a confirmation next to an end
        when the guess is that close to it."""
        low, high, granularity = self.low, self.high, self.granularity
        guess = self._guess()
        length = _round_down(guess, granularity)
        if high is not None and length + tolerance(length, granularity) >= high:
            length = high - _tolerance_below(high, granularity)  # expected to fit: confirm from below
        elif low and length <= low + tolerance(low, granularity):
            length = low + tolerance(low, granularity)  # expected not to fit: confirm from above
        top = self.ceiling if high is None else high - granularity
        return min(max(length, low + granularity if low else granularity), top)

    def _guess(self) -> float:
        low, high, peaks, usable = self.low, self.high, self.peaks, self.usable
        if low and high is not None:
            under = (peaks[low] - usable) * self.weights[True]
            over = (peaks[high] - usable) * self.weights[False]
            return low + (high - low) * -under / (over - under)
        # One side only: the line through its two lengths nearest the boundary, or its one length and `fixed`.
        side = sorted(peaks, reverse=high is None)[:2]
        points = [(length, peaks[length]) for length in side]
        if len(points) == 1 and self.fixed is not None:
            points.append((0, self.fixed))
        if len(points) == 2:
            (l0, p0), (l1, p1) = sorted(points)
            if p1 > p0 and l1 > l0:
                guess = l0 + (usable - p0) * (l1 - l0) / (p1 - p0)
                # A line from far away can miss by decades: go at most 64 times longer or shorter per step.
                return min(guess, 64 * low) if high is None else max(guess, high / 64)
        return 4 * low if high is None else high / 4


def _tolerance_below(length: int, granularity: int = GRANULARITY) -> int:
    """The step below ``length`` that closes a bracket whose top is ``length``: the largest ``step`` with
    ``step <= tolerance(length - step)``."""
    step = tolerance(length, granularity)
    while step > granularity and step > tolerance(length - step, granularity):
        step -= granularity
    return step
