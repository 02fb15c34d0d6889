"""Peak device memory against sequence length, one line per technique combination, as a PNG.

The figure of the TRL long-context guide (peak memory of Qwen3-4B against the sequence length, one line per
technique, the GPU's memory as a ceiling), here simulated for the user's own model and settings. Each line
is drawn through simulated points only (no extrapolation); a marker shows each line's longest length that
fits.
"""

from __future__ import annotations

from collections.abc import Callable

from lit_memtrain.planner.plan import Budget, ComparisonRow

__all__ = ["plot_lengths", "write_plot"]

GIB = 2**30


def _tokens(length: float) -> str:
    if length >= 2**20:
        return f"{length / 2**20:g}M"
    return f"{length / 2**10:g}k" if length >= 2**10 else f"{length:g}"


def plot_lengths(rows: list[ComparisonRow], configured: int) -> list[int]:
    """Lengths to simulate for every row: powers of two from 4k to twice the longest length that fits
    (or the configured length, if larger), at least five of them."""
    longest = max([row.search.max_length for row in rows if row.search is not None] + [configured])
    lengths, length = [], 4096
    while length <= 2 * longest or len(lengths) < 5:
        lengths.append(length)
        length *= 2
    return lengths


def write_plot(
    path: str,
    rows: list[ComparisonRow],
    peak_at: Callable[[ComparisonRow, int], int],
    lengths: list[int],
    budget: Budget,
    title: str,
) -> None:
    """Draw ``peak_at(row, length)`` for every simulated row at ``lengths`` (plus the lengths each row's search
    already simulated) and write a PNG to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    figure, axes = plt.subplots(figsize=(9, 5.5))
    for row in rows:
        if row.step is None:
            continue
        points = {length: peak_at(row, length) for length in lengths}
        if row.search is not None:
            points.update(row.search.peaks)
        xs = sorted(points)
        line = axes.plot(xs, [points[x] / GIB for x in xs], marker="o", markersize=3, label=row.name)[0]
        if row.search is not None and row.search.max_length:
            longest = row.search.max_length
            axes.plot([longest], [points[longest] / GIB], marker="*", markersize=12, color=line.get_color())
    gpu_label = f"GPU memory ({budget.gpu_memory / GIB:.3g} GiB)"
    axes.axhline(budget.gpu_memory / GIB, color="black", linewidth=1.5, label=gpu_label)
    axes.axhline(budget.usable / GIB, color="black", linestyle="--", linewidth=1,
                 label=f"usable after a {budget.margin:.0%} margin")  # fmt: skip
    axes.set_xscale("log", base=2)
    axes.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda length, _: _tokens(length)))
    axes.set_yscale("log")
    axes.set_xlabel("sequence length (tokens per row)")
    axes.set_ylabel("simulated peak device memory (GiB)")
    axes.set_title(title, fontsize=10)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize=8, loc="upper left")
    figure.text(0.99, 0.01, "* longest length that fits", ha="right", fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
