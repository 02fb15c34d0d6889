"""The W&B sweep's search space, tried offline: a local grid over the keys of ``configs/sweep.yaml``, one
``lit-memtrain fit --config configs/sweep_base.yaml`` per point, each run's memory-bounded throughput printed.

Why: ``wandb sweep`` needs a W&B account and a network; trying what the sweep searches should not. Each run is the
command a sweep agent starts (``--key=value`` per swept key), logging offline, with ``--size cpu`` (the default)
shrinking the base config's Qwen3-0.6B (its 151,936-token head at 8 x 2,048 tokens: minutes per step on a CPU) to
the quickstart's model at 8 x 256 tokens, so that each run takes seconds. The objective is the one the sweep
maximises: ``MemoryBoundedThroughput`` prints ``sweep/objective`` (tokens per second after warm-up, or 0 when the
peak memory went over its ``max_memory_gib``), and the table ends with the best point.

The grid: every value of each categorical key (``data.packing``, ``model.attn_implementation``,
``model.loss_chunk_size``, the checkpointing modes of ``trainer.callbacks+``), ``sdpa_by_document`` only with
packing (without it, both are plain ``sdpa``), and the learning rate at the base config's (it does not change the
throughput: docs/sweeps.md). 45 points by default; ``--fix key=value`` holds a key at one value.

Usage::

    python benchmarks/sweep_grid.py --fix data.packing=true model.attn_implementation=sdpa_by_document \
        model.loss_chunk_size=1024                    # the 5 checkpointing modes: 46 s of CPU time
    python benchmarks/sweep_grid.py                   # all 45 points
    python benchmarks/sweep_grid.py --size base   # the base config as it is (for a GPU)
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
SWEEP = ROOT / "configs" / "sweep.yaml"
BASE = "configs/sweep_base.yaml"
# The quickstart's model and a short row instead of Qwen3-0.6B at 8 x 2,048 tokens: seconds per run on a CPU.
CPU_SIZE = [
    "--model.preset=tiny-qwen3", "--model.config_overrides={vocab_size: 512}", "--model.dtype=float32",
    "--trainer.accelerator=cpu", "--trainer.precision=32-true", "--data.max_length=256", "--trainer.max_steps=12",
]  # fmt: skip
OFFLINE = ["--trainer.logger.init_args.offline=true", "--trainer.enable_progress_bar=false"]
OBJECTIVE = re.compile(r"sweep/objective ([\d.]+): ([\d.]+) tokens/s .*peak memory ([\d.]+) GiB")


def grid(fixed: dict[str, str]) -> list[dict[str, str]]:
    """The points of the sweep's categorical keys (``fixed`` holding some at one value), as ``--key=value`` text."""
    parameters = yaml.safe_load(SWEEP.read_text())["parameters"]
    keys = [key for key, spec in parameters.items() if "values" in spec]
    unknown = set(fixed) - set(parameters)
    if unknown:
        names = ", ".join(sorted(unknown))
        raise SystemExit(f"sweep_grid: {names} is not a key of {SWEEP.name}: {', '.join(parameters)}")
    choices = [[fixed[key]] if key in fixed else [_text(value) for value in parameters[key]["values"]] for key in keys]
    points = [dict(zip(keys, values)) for values in itertools.product(*choices)]
    by_document_unpacked = {"model.attn_implementation": "sdpa_by_document", "data.packing": "false"}
    return [point for point in points if not by_document_unpacked.items() <= point.items()]


def _text(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def run(point: dict[str, str], size: list[str]) -> tuple[float, float, float] | None:
    """One fit at ``point``: (objective, tokens per second, peak GiB), or None when it printed no objective."""
    command = [sys.executable, "-m", "lit_memtrain.cli", "fit", "--config", BASE, *size, *OFFLINE]
    command += [f"--{key}={value}" for key, value in point.items()]
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))  # this tree's code
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": path}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    found = OBJECTIVE.search(done.stdout + done.stderr)
    if found is None:
        print((done.stdout + done.stderr)[-2000:], file=sys.stderr)
        return None
    return float(found.group(1)), float(found.group(2)), float(found.group(3))


def _label(point: dict[str, str]) -> str:
    mode = point.get("trainer.callbacks+", "[]")
    if mode != "[]":
        settings = yaml.safe_load(mode)["init_args"]
        mode = "+".join(name for name in ("selective", "offload") if settings[name]) or "full"
    else:
        mode = "off"
    return (
        f"packing={point.get('data.packing')} attn={point.get('model.attn_implementation')} "
        f"chunk={point.get('model.loss_chunk_size')} checkpointing={mode}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fix", nargs="*", default=[], metavar="KEY=VALUE", help="hold a swept key at one value")
    parser.add_argument("--size", choices=("cpu", "base"), default="cpu", help="cpu: the quickstart's model (default)")
    args = parser.parse_args(argv)
    fixed = {key: _text(yaml.safe_load(value)) for key, value in (item.split("=", 1) for item in args.fix)}
    points = grid(fixed)
    size = CPU_SIZE if args.size == "cpu" else []
    print(f"{len(points)} runs of lit-memtrain fit --config {BASE}{' (CPU size)' if size else ''}", flush=True)
    results = []
    for number, point in enumerate(points, 1):
        measured = run(point, size)
        text = "no objective printed (the run failed)" if measured is None else (
            f"objective {measured[0]:9.1f}  tokens/s {measured[1]:9.1f}  peak {measured[2]:6.2f} GiB"
        )
        print(f"{number:3d}/{len(points)}  {_label(point):80s} {text}", flush=True)
        if measured is not None:
            results.append((measured[0], point))
    if results:
        objective, best = max(results, key=lambda result: result[0])
        print(f"best: {_label(best)} (objective {objective:.1f})")
    return 0 if len(results) == len(points) else 1


if __name__ == "__main__":
    raise SystemExit(main())
