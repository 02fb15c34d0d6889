"""``lit-memtrain curves``: a run's logged metrics against steps, as a PNG, from the metrics file its CSVLogger wrote.

Why a command: the docs show each recipe's curve (its loss, reward or accuracy over training), and a figure redrawn
by hand from numbers copied out of a log can say anything; this one is drawn from the run's own ``metrics.csv``
(``<save_dir>/lightning_logs/version_<n>/metrics.csv``), one panel per metric, every logged point shown, so anyone
can make it again from the same run.

Example::

    lit-memtrain curves --metrics outputs/smollm2_reward/lightning_logs/version_0/metrics.csv \\
        --keys train/loss train/accuracy val/accuracy --output docs/images/smollm2_reward.png
    lit-memtrain curves --metrics outputs/smollm2_reward --keys train/loss --output loss.png  # its latest run
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

__all__ = ["curves", "newest_metrics_file", "read_curves", "write_curves"]

Curve = list[tuple[int, float]]


def curves(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="lit-memtrain curves",
        description="Draw logged metrics against steps from a CSVLogger's metrics.csv, one panel per metric, as a PNG.",
    )
    parser.add_argument(
        "--metrics", required=True,
        help="the metrics.csv a CSVLogger wrote (<save_dir>/lightning_logs/version_<n>/metrics.csv), or a folder: "
        "the newest metrics.csv under it (a config's save_dir: its latest run)",
    )  # fmt: skip
    parser.add_argument("--keys", required=True, nargs="+", help="logged metric names, e.g. train/loss val/accuracy")
    parser.add_argument("--output", required=True, metavar="FILE.png", help="the PNG to write")
    parser.add_argument("--title", default=None, help="the figure's title (default: the metrics file)")
    args = parser.parse_args(argv)
    metrics = newest_metrics_file(args.metrics)
    found = read_curves(metrics, args.keys)
    write_curves(args.output, found, args.title or str(metrics))
    points = ", ".join(
        f"{key}: {len(curve)} points, steps {curve[0][0]}-{curve[-1][0]}"
        for key, curve in found.items()
    )
    print(f"wrote {args.output} from {metrics} ({points})")


def newest_metrics_file(path: str | Path) -> Path:
    """``path`` itself, or for a folder the most recently written ``metrics.csv`` under it (a config's ``save_dir``
    holds one ``lightning_logs/version_<n>`` per run, and ``n`` sorts as text: version_10 before version_2).

    Raises:
        FileNotFoundError: a folder with no ``metrics.csv`` under it.
    """
    path = Path(path)
    if not path.is_dir():
        return path
    found = sorted(path.rglob("metrics.csv"), key=lambda file: file.stat().st_mtime)
    if not found:
        raise FileNotFoundError(
            f"--metrics {path}: no metrics.csv under this folder. A CSVLogger writes "
            "<save_dir>/lightning_logs/version_<n>/metrics.csv (trainer.logger: lightning.pytorch.loggers.CSVLogger)."
        )
    return found[-1]


def read_curves(path: str | Path, keys: list[str]) -> dict[str, Curve]:
    """Each key's logged ``(step, value)`` points, in the file's order (rows where the key is empty are other
    metrics' rows: Lightning's CSVLogger writes one row per logging call, with every column of the run).

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: the file has no ``step`` column, no column for a key (the message lists those it has), no value
            for a key, or a value that is not a number.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"--metrics {path}: no such file. A CSVLogger writes <save_dir>/lightning_logs/version_<n>/metrics.csv "
            "(trainer.logger: lightning.pytorch.loggers.CSVLogger)."
        )
    with path.open(newline="") as file:
        reader = csv.DictReader(file)
        columns = reader.fieldnames or []
        rows = list(reader)
    if "step" not in columns:
        listed = ", ".join(columns) or "none"
        raise ValueError(f"{path} has no 'step' column (columns: {listed}): not a metrics file a CSVLogger wrote.")
    metrics = [column for column in columns if column not in ("epoch", "step")]
    missing = [key for key in keys if key not in columns]
    if missing:
        raise ValueError(f"{path} has no metric {', '.join(map(repr, missing))}; it logged: {', '.join(metrics)}.")
    found: dict[str, Curve] = {key: [] for key in keys}
    for line, row in enumerate(rows, start=2):
        for key in keys:
            text = row[key]
            if not text:
                continue
            try:
                value, step = float(text), int(row["step"])
            except ValueError:
                raise ValueError(
                    f"{path}, line {line}: {key}={text!r} at step={row['step']!r} is not a number."
                ) from None
            found[key].append((step, value))
    empty = [key for key, curve in found.items() if not curve]
    if empty:
        raise ValueError(f"{path} has a column but no value for {', '.join(map(repr, empty))}.")
    return found


def write_curves(path: str | Path, found: dict[str, Curve], title: str) -> None:
    """Draw each curve in a panel of its own (metrics of other scales share no axis), steps on a shared x axis, every
    logged point marked, and write a PNG to ``path`` (its folder made if missing)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(len(found), 1, sharex=True, figsize=(8, 1.2 + 2.2 * len(found)), squeeze=False)
    for axis, (key, curve) in zip(axes[:, 0], found.items()):
        steps, values = zip(*curve)
        axis.plot(steps, values, marker="o", markersize=3)
        axis.set_ylabel(key)
        axis.grid(True, alpha=0.3)
        axis.set_title(f"{key}: {values[0]:.4g} at step {steps[0]} -> {values[-1]:.4g} at step {steps[-1]}",
                       fontsize=9, loc="left")  # fmt: skip
    axes[-1, 0].set_xlabel("step")
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
