"""Benchmark: a plan simulated with every decoder layer (as before) against a few layers extrapolated (now).

Both are :func:`lit_memtrain.planner.step.simulate_fit_step` on the same settings, side by side in one process:
``whole=True`` runs the step with all of the model's layers, the default runs it with ``2a + 1`` and ``2a + 2``
layers and extrapolates (:mod:`lit_memtrain.planner.layers`). CPU time of the simulation alone (a fresh
``lit-memtrain plan`` adds 5-10 s of imports to either), and the simulated peak, which must be the same.

The configurations are the issue's: Qwen3-8B at 1,048,576 tokens on one rank with every technique
(``configs/plan_qwen3_8b_1m.yaml --trainer.devices=1``: FSDP2 with ``cpu_offload``, chunked loss, offloaded
checkpoints, tiled MLP, chunked RMSNorm), Llama-3.1-8B at 786,432 tokens with the same techniques, and the
Qwen3-4B plan of ``configs/plan_qwen3_4b.yaml`` (98,304 tokens, checkpointing and the chunked loss).

Run::

    python benchmarks/planner_extrapolation.py           # ~2 minutes of CPU, mostly the whole-model simulations
"""

from __future__ import annotations

import time
import warnings

GIB = 2**30
CASES = {
    "Qwen3-8B, 1,048,576 tokens, one rank, every technique": [
        "--config", "configs/plan_qwen3_8b_1m.yaml", "--trainer.devices=1",
    ],
    "Llama-3.1-8B, 786,432 tokens, one rank, every technique": [
        "--config", "configs/plan_qwen3_8b_1m.yaml", "--trainer.devices=1", "--model.preset=llama-3.1-8b",
        "--model.config_overrides={}", "--data.max_length=786432",
    ],
    "Qwen3-4B, 98,304 tokens (configs/plan_qwen3_4b.yaml)": ["--config", "configs/plan_qwen3_4b.yaml"],
}  # fmt: skip


def main() -> None:
    warnings.filterwarnings("ignore")
    from lit_memtrain.planner.simulate import stand_in_device

    stand_in_device()
    from lit_memtrain.cli.plan import read_fit_config
    from lit_memtrain.planner.step import simulate_fit_step

    print("| configuration | every layer (before) | extrapolated (now) | ratio | peak (both) |")
    print("|---|---|---|---|---|")
    for name, arguments in CASES.items():
        settings = read_fit_config(arguments)
        simulate_fit_step(settings, max_length=1024)  # warm-up: the first step of a process pays one-off costs
        seconds, peaks = {}, {}
        for whole in (True, False):
            start = time.process_time()
            step = simulate_fit_step(settings, whole=whole)
            seconds[whole], peaks[whole] = time.process_time() - start, step.memory.device_peak
        same = "" if peaks[True] == peaks[False] else f" DIFFERENT: {peaks[False] / GIB:,.2f} GiB extrapolated"
        print(
            f"| {name} | {seconds[True]:.1f} s | {seconds[False]:.1f} s | {seconds[True] / seconds[False]:.1f}x | "
            f"{peaks[True] / GIB:,.2f} GiB{same} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
