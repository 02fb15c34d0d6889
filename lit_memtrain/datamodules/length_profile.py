"""Profile a dataset's token lengths to choose ``max_length`` and see what padding would waste.

Why: ``max_length`` decides both memory (activations grow with it) and what is lost (tokens past
it are truncated). The right value depends on the length distribution, and whether to pack or pad
depends on how much padding a given ``max_length`` would cost. This report answers both from the
per-example token counts alone, without a model: for each candidate ``max_length`` it gives the
share of tokens and examples truncated and the share of token slots wasted by three layouts --
padding each batch to its longest example, padding every example to ``max_length``, and packing
with Best-Fit Decreasing (:func:`lit_memtrain.datamodules.packing_plan.plan_packing`).

Recommendation rule: the smallest candidate that truncates at most ``max_truncated_token_share``
(1% by default) of all tokens; the largest candidate when none does.

Data that is never packed (DPO's pairs: each profiled length is one sequence, prompt + chosen or prompt +
rejected, and a batch of ``B`` pairs is ``2 B`` of them) is profiled with ``packing=False``: the packing
columns are left out rather than offering a layout the data cannot take.

Usage (notebook)::

    from lit_memtrain.datamodules.length_profile import profile_lengths, write_histogram

    lengths = np.array([len(ids) for ids in tokenised["input_ids"]])
    report = profile_lengths(lengths, candidates=[1024, 2048, 4096], batch_size=8)
    print(report.to_table())
    write_histogram(report, "token_lengths.png")
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from lit_memtrain.datamodules.packing_plan import plan_packing

PERCENTILES: tuple[int, ...] = (50, 90, 95, 99)


@dataclass(frozen=True)
class CandidateProfile:
    """What one ``max_length`` would truncate and waste (all shares in [0, 1])."""

    max_length: int
    truncated_token_share: float
    truncated_example_share: float
    batch_padding_waste: float
    max_length_padding_waste: float
    packing_waste: float | None
    packed_rows: int | None


@dataclass(frozen=True)
class LengthProfile:
    """Length statistics and one :class:`CandidateProfile` per candidate ``max_length``.

    ``percentiles`` maps ``"p50"``, ``"p90"``, ``"p95"``, ``"p99"`` and ``"max"`` to lengths;
    ``configured_max_length`` is the configuration's own ``max_length``, when given, named under the table.
    """

    num_examples: int
    num_tokens: int
    percentiles: dict[str, float]
    batch_size: int
    candidates: tuple[CandidateProfile, ...]
    recommended_max_length: int
    max_truncated_token_share: float
    lengths: np.ndarray = field(repr=False, compare=False)
    configured_max_length: int | None = None

    def to_table(self) -> str:
        """The report as a plain-text table; the recommended row is marked with ``*``."""
        stats = ", ".join(f"{name} {value:g}" for name, value in self.percentiles.items())
        packed = self.candidates[0].packed_rows is not None
        lines = [
            f"{self.num_examples:,} examples, {self.num_tokens:,} tokens; lengths: {stats}",
            f"padded batches: {self.batch_size} examples each, in dataset order"
            + ("; packed: Best-Fit Decreasing" if packed else ""),
            "",
        ]
        header = ("  max_length", "tokens cut", "examples cut", "waste padded/batch", "waste padded/max")
        header += ("waste packed", "packed rows") if packed else ()
        rows = [header]
        for candidate in self.candidates:
            marker = "*" if candidate.max_length == self.recommended_max_length else " "
            row = (
                f"{marker} {candidate.max_length}",
                _percent(candidate.truncated_token_share),
                _percent(candidate.truncated_example_share),
                _percent(candidate.batch_padding_waste),
                _percent(candidate.max_length_padding_waste),
            )
            if packed:
                row += (_percent(candidate.packing_waste), f"{candidate.packed_rows:,}")
            rows.append(row)
        widths = [max(len(row[column]) for row in rows) for column in range(len(header))]
        lines += ["  ".join(cell.rjust(width) for cell, width in zip(row, widths)) for row in rows]
        lines += [
            "",
            f"* recommended: the smallest max_length truncating at most "
            f"{_percent(self.max_truncated_token_share)} of tokens",
        ]
        configured = next((c for c in self.candidates if c.max_length == self.configured_max_length), None)
        if configured is not None:
            lines.append(
                f"configured max_length {configured.max_length}: cuts {_percent(configured.truncated_token_share)} "
                f"of tokens, in {_percent(configured.truncated_example_share)} of examples"
            )
        return "\n".join(lines)


def profile_lengths(
    lengths: Sequence[int] | np.ndarray,
    candidates: Iterable[int] | None = None,
    batch_size: int = 8,
    max_truncated_token_share: float = 0.01,
    configured: int | None = None,
    packing: bool = True,
) -> LengthProfile:
    """Profile per-example token ``lengths`` against candidate ``max_length`` values.

    ``candidates`` defaults to the powers of two from the largest one not above the median length
    up to the smallest one not below the longest example; ``configured`` (a configuration's
    ``max_length``) is profiled too. ``packing=False``: no packing figures (data that is not packed).
    """
    lengths = np.asarray(lengths)
    if lengths.ndim != 1 or lengths.size == 0 or not np.issubdtype(lengths.dtype, np.integer):
        raise ValueError(
            "lengths must be a non-empty 1-D array of integer token counts, got shape "
            f"{lengths.shape} and dtype {lengths.dtype}."
        )
    lengths = lengths.astype(np.int64)
    if lengths.min() < 0:
        raise ValueError(f"lengths must be >= 0, found {int(lengths.min())}.")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}.")
    if not 0.0 <= max_truncated_token_share < 1.0:
        raise ValueError(
            f"max_truncated_token_share must be in [0, 1), got {max_truncated_token_share!r}."
        )
    candidate_lengths = _default_candidates(lengths) if candidates is None else list(candidates)
    if configured is not None:
        candidate_lengths.append(configured)
    if not candidate_lengths or any(
        isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1
        for value in candidate_lengths
    ):
        raise ValueError(f"candidates must be a non-empty list of integers >= 1, got {candidates!r}.")
    candidate_lengths = sorted(set(int(value) for value in candidate_lengths))
    profiles = tuple(
        _profile_candidate(lengths, max_length, batch_size, packing) for max_length in candidate_lengths
    )
    percentiles = {f"p{q}": float(np.percentile(lengths, q)) for q in PERCENTILES}
    percentiles["max"] = float(lengths.max())
    return LengthProfile(
        num_examples=len(lengths),
        num_tokens=int(lengths.sum()),
        percentiles=percentiles,
        batch_size=batch_size,
        candidates=profiles,
        recommended_max_length=recommend_max_length(profiles, max_truncated_token_share),
        max_truncated_token_share=max_truncated_token_share,
        lengths=lengths,
        configured_max_length=configured,
    )


def recommend_max_length(
    candidates: Sequence[CandidateProfile], max_truncated_token_share: float = 0.01
) -> int:
    """The smallest candidate truncating at most ``max_truncated_token_share`` of tokens, or the
    largest candidate when none does."""
    if not candidates:
        raise ValueError("recommend_max_length needs at least one candidate.")
    ordered = sorted(candidates, key=lambda candidate: candidate.max_length)
    for candidate in ordered:
        if candidate.truncated_token_share <= max_truncated_token_share:
            return candidate.max_length
    return ordered[-1].max_length


def write_histogram(
    report_or_lengths: LengthProfile | Sequence[int] | np.ndarray, path: str | Path
) -> Path:
    """Write a PNG histogram of the lengths with the recommended ``max_length`` marked.

    Accepts a :class:`LengthProfile` or raw lengths (profiled with the defaults). Draws with the
    Agg canvas directly, so it works headless and leaves pyplot's state alone.
    """
    report = (
        report_or_lengths
        if isinstance(report_or_lengths, LengthProfile)
        else profile_lengths(report_or_lengths)
    )
    from matplotlib.figure import Figure  # here: GPU machines may lack matplotlib, and only plots need it

    path = Path(path)
    figure = Figure(figsize=(8, 4.5), layout="constrained")
    axes = figure.subplots()
    axes.hist(report.lengths, bins=min(100, max(10, int(np.sqrt(report.num_examples)))))
    axes.axvline(
        report.recommended_max_length,
        color="tab:red",
        linestyle="--",
        label=f"recommended max_length {report.recommended_max_length}",
    )
    axes.axvline(
        report.percentiles["p99"],
        color="tab:gray",
        linestyle=":",
        label=f"p99 {report.percentiles['p99']:g}",
    )
    axes.set_xlabel("tokens per example")
    axes.set_ylabel("examples")
    axes.set_title(f"{report.num_examples:,} examples, {report.num_tokens:,} tokens")
    axes.legend()
    figure.savefig(path, dpi=100)
    return path


def _profile_candidate(lengths: np.ndarray, max_length: int, batch_size: int, packing: bool) -> CandidateProfile:
    kept = np.minimum(lengths, max_length)
    total, kept_total = int(lengths.sum()), int(kept.sum())
    batch_starts = np.arange(0, len(kept), batch_size)
    batch_longest = np.maximum.reduceat(kept, batch_starts)
    batch_sizes = np.diff(np.append(batch_starts, len(kept)))
    packing_waste, packed_rows = None, None
    if packing:
        plan = plan_packing(lengths, max_length, "bfd")
        packing_waste, packed_rows = (1.0 - plan.fill if plan.num_rows else 0.0), plan.num_rows
    return CandidateProfile(
        max_length=max_length,
        truncated_token_share=_share(total - kept_total, total),
        truncated_example_share=float(np.mean(lengths > max_length)),
        batch_padding_waste=1.0 - _share(kept_total, int((batch_longest * batch_sizes).sum()), 1.0),
        max_length_padding_waste=1.0 - _share(kept_total, len(kept) * max_length, 1.0),
        packing_waste=packing_waste,
        packed_rows=packed_rows,
    )


def _default_candidates(lengths: np.ndarray) -> list[int]:
    low = int(math.floor(math.log2(max(float(np.median(lengths)), 1.0))))
    high = max(int(math.ceil(math.log2(max(int(lengths.max()), 1)))), low)
    return [2**exponent for exponent in range(low, high + 1)]


def _share(part: int, whole: int, when_empty: float = 0.0) -> float:
    return part / whole if whole else when_empty


def _percent(share: float) -> str:
    return f"{100 * share:.2f}%"
