"""Peak device memory against sequence length, one line per technique combination, as a PNG.

The figure of the TRL long-context guide (peak memory of Qwen3-4B against the sequence length, one line per
technique, the GPU's memory as a ceiling), here simulated for the user's own model and settings. A marker shows each
line's longest length that fits.

Which points: those each row's length search simulated (the configured length, and the guesses and confirmations
around its longest length), and no more. Each simulation takes seconds for a large model, and a figure drawn through
more lengths would cost a minute per row; the peak is affine in the length to within a few percent (each part of a
step's memory grows linearly with the sequence, with O(L) attention), so each line is drawn as straight between its
simulated points *in linear scale* (densely sampled, so that the log axes show the curve ``a + b * L`` makes), from
the shortest length its row simulated to the longest, never past them.
"""

from __future__ import annotations

from lit_memtrain.planner.plan import Budget, ComparisonRow

__all__ = ["write_plot"]

GIB = 2**30


def _tokens(length: float) -> str:
    if length >= 2**20:
        return f"{length / 2**20:g}M"
    return f"{length / 2**10:g}k" if length >= 2**10 else f"{length:g}"


def write_plot(path: str, rows: list[ComparisonRow], budget: Budget, title: str) -> None:
    """Draw the peaks each simulated row's search simulated (``row.search.peaks`` and the configured length's) and
    write a PNG to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    figure, axes = plt.subplots(figsize=(9, 5.5))
    for row in rows:
        if row.step is None:
            continue
        points = {row.step.max_length: row.step.memory.device_peak}
        if row.search is not None:
            points.update(row.search.peaks)
        xs, ys = _affine_between(sorted(points.items()))
        line = axes.plot(xs, [peak / GIB for peak in ys], label=row.name)[0]
        axes.plot(sorted(points), [points[x] / GIB for x in sorted(points)], "o", markersize=3, color=line.get_color())
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


def _affine_between(points: list[tuple[int, int]], samples: int = 32) -> tuple[list[float], list[float]]:
    """``points`` joined by straight lines in linear scale, sampled at lengths evenly spaced on a log scale (so that
    the log-log figure shows each piece's curve)."""
    xs, ys = [float(points[0][0])], [float(points[0][1])]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        for step in range(1, samples + 1):
            x = x0 * (x1 / x0) ** (step / samples)
            xs.append(x)
            ys.append(y0 + (y1 - y0) * (x - x0) / (x1 - x0))
    return xs, ys
