"""Benchmark: FSDP2Strategy on the CPU (2 ranks against 1) and the simulated per-rank peak of large models.

CPU part (real runs, side by side in one invocation): a small Qwen3 (hidden 256, MLP 768, 4 layers,
vocabulary 8192) trained for a few steps on rows of 1024 tokens in one process (Lightning's default
strategy) with one thread and with two, and with ``FSDP2Strategy`` over 2 ranks forked from this process
(gloo, one thread per rank). Reported: tokens per second over all ranks (after a warm-up step) and the parameter
bytes each rank holds, which sharding must halve.

Simulated part (:func:`lit_memtrain.planner.sharded.simulate_sharded_step`, fake tensors, torch's own
``fully_shard`` on a fake process group; allocations only): the per-rank peak of one step of Qwen3-4B and
Llama-3.1-8B with every technique (chunked loss, checkpointing with offloaded layer inputs, tiled MLP),
fp32 master weights and AdamW state, bf16 compute, on 1, 2 and 8 GPUs, with and without ``cpu_offload``.
Each simulation runs in a process of its own; results are kept in ``--json`` as they come, so an
interrupted run resumes where it stopped.

Run::

    python benchmarks/fsdp2.py --part cpu
    python benchmarks/fsdp2.py --part simulate --json fsdp2_simulated.json   # hours on 2 loaded cores
    python benchmarks/fsdp2.py --part simulate --models qwen3-4b --lengths 524288 --gpus 1 --offload on
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import tempfile
import time
from pathlib import Path

import torch

GIB = 2**30
SMALL_QWEN3 = {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4, "num_attention_heads": 4,
               "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 8192}


def _cpu_run(ranks: int, threads: int, seq_len: int, steps: int, result_path: str) -> None:
    from lightning.pytorch import Callback, Trainer
    from torch.distributed.tensor import DTensor
    from torch.utils.data import DataLoader

    from lit_memtrain.objectives.causal_lm import CausalLMModule
    from lit_memtrain.strategies import FSDP2Strategy

    class Measure(Callback):
        def __init__(self) -> None:
            self.started: list[float] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self.started.append(time.perf_counter())

        def on_train_end(self, trainer, pl_module) -> None:
            seconds = time.perf_counter() - self.started[1]  # from the end of the warm-up step
            local = [p.to_local() if isinstance(p, DTensor) else p for p in pl_module.parameters()]
            if trainer.is_global_zero:
                tokens = (len(self.started) - 1) * seq_len * trainer.world_size
                result = {"tokens_per_sec": tokens / seconds, "parameter_bytes": sum(t.nbytes for t in local)}
                Path(result_path).write_text(json.dumps(result))

    generator = torch.Generator().manual_seed(0)
    rows = [
        {"input_ids": ids, "labels": ids.clone()}
        for ids in torch.randint(0, SMALL_QWEN3["vocab_size"], (steps * ranks, seq_len), generator=generator)
    ]
    torch.set_num_threads(threads)  # forked ranks: Lightning sets one thread each
    torch.manual_seed(0)
    module = CausalLMModule(preset="qwen3-1.7b", config_overrides=SMALL_QWEN3, learning_rate=1e-4)
    options = {"strategy": FSDP2Strategy(start_method="fork"), "devices": ranks} if ranks > 1 else {"devices": 1}
    trainer = Trainer(
        accelerator="cpu", max_steps=steps, callbacks=[Measure()], logger=False, enable_progress_bar=False,
        enable_checkpointing=False, enable_model_summary=False, **options,
    )
    trainer.fit(module, DataLoader(rows, batch_size=1, collate_fn=lambda b: {k: v[None] for k, v in b[0].items()}))


CPU_RUNS = [("1 process, 1 thread", 1, 1), ("1 process, 2 threads", 1, 2), ("FSDP2, 2 ranks x 1 thread", 2, 1)]


def cpu_table(seq_len: int, steps: int) -> None:
    results = {}
    with tempfile.TemporaryDirectory() as directory:
        for name, ranks, threads in CPU_RUNS:
            path = os.path.join(directory, "result.json")
            _cpu_run(ranks, threads, seq_len, steps, path)
            results[name] = json.loads(Path(path).read_text())
    one = results[CPU_RUNS[0][0]]
    print(f"\nCPU, small Qwen3 (hidden 256, 4 layers, vocabulary 8192), {seq_len} tokens per row, {steps} steps, "
          f"{os.cpu_count()} cores")
    print("| run | tokens/s (all ranks) | parameter bytes per rank |")
    print("|---|---|---|")
    for name, result in results.items():
        print(f"| {name} | {result['tokens_per_sec']:.0f} ({result['tokens_per_sec'] / one['tokens_per_sec']:.2f}x) | "
              f"{result['parameter_bytes']:,} ({result['parameter_bytes'] / one['parameter_bytes']:.3f}x) |")


def _simulate(model: str, seq_len: int, gpus: int, offload: bool) -> dict:
    from lit_memtrain.planner.sharded import simulate_sharded_step

    start = time.perf_counter()
    report = simulate_sharded_step(model, seq_len, world_size=gpus, cpu_offload=offload)
    return {
        "device_peak_gib": report.device_peak_gib,
        "host_peak_gib": report.host_peak_gib,
        "device_at_peak_gib": {kind: size / GIB for kind, size in report.device_at_peak.items()},
        "fixed_gib": report.fixed / GIB,
        "seconds": time.perf_counter() - start,
    }


def simulated_table(models: list[str], lengths: list[int], gpus: list[int], offloads: list[bool], path: Path) -> None:
    results = json.loads(path.read_text()) if path.exists() else {}
    for model in models:
        for seq_len in lengths:
            for offload in offloads:
                for count in gpus:
                    key = f"{model}/{seq_len}/{count}/{'offload' if offload else 'device'}"
                    if key in results:
                        continue
                    # One process per simulation: the stand-in device and the fake process group stay there.
                    with multiprocessing.get_context("spawn").Pool(1) as pool:
                        results[key] = pool.apply(_simulate, (model, seq_len, count, offload))
                    path.write_text(json.dumps(results, indent=1))
                    print(key, {k: v for k, v in results[key].items() if k != "device_at_peak_gib"}, flush=True)
    print("\nSimulated per-rank peak, GiB of device memory [host memory] (fp32 master weights and AdamW state, "
          "bf16 compute, chunked loss, checkpointing with offloaded inputs, tiled MLP)")
    header = [f"{count} GPU{'s' if count > 1 else ''}{', cpu_offload' if offload else ''}"
              for offload in offloads for count in gpus]
    print("| model | tokens | " + " | ".join(header) + " |")
    print("|---|---|" + "---|" * len(header))
    for model in models:
        for seq_len in lengths:
            cells = []
            for offload in offloads:
                for count in gpus:
                    result = results.get(f"{model}/{seq_len}/{count}/{'offload' if offload else 'device'}")
                    cells.append("-" if result is None else
                                 f"{result['device_peak_gib']:.1f} [{result['host_peak_gib']:.0f}]")
            print(f"| {model} | {seq_len:,} | " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["cpu", "simulate", "both"], default="both")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--models", nargs="+", default=["qwen3-4b", "llama-3.1-8b"])
    parser.add_argument("--lengths", type=int, nargs="+", default=[131072, 524288])
    parser.add_argument("--gpus", type=int, nargs="+", default=[1, 2, 8])
    parser.add_argument("--offload", choices=["off", "on", "both"], default="both")
    parser.add_argument("--json", type=Path, default=Path("fsdp2_simulated.json"), help="simulation results (kept)")
    args = parser.parse_args()
    if args.part in ("cpu", "both"):
        cpu_table(args.seq_len, args.steps)
    if args.part in ("simulate", "both"):
        offloads = {"off": [False], "on": [True], "both": [False, True]}[args.offload]
        simulated_table(args.models, args.lengths, args.gpus, offloads, args.json)


if __name__ == "__main__":
    main()
