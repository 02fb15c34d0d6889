"""Benchmark: simulated per-rank peak of one 1,048,576-token step of Qwen3-8B and Qwen3-4B on 2, 4 and 8 GPUs.

What runs is ``lit-memtrain plan``'s simulation (:func:`lit_memtrain.planner.step.simulate_fit_step`: the
``CausalLMModule`` step on fake tensors, torch's ``fully_shard`` on a fake process group, the context-parallel
attention of :mod:`lit_memtrain.parallel.context_parallel` installed on the model and the row cut by its ``shard_batch``),
once per row of the table, all in this process. Allocations only: no kernel workspaces, CUDA context or
fragmentation (``lit-memtrain plan`` keeps a 10% margin for them).

"Every technique" is the project's 1M-token recipe: fp32 master weights and AdamW state kept in host memory
(``FSDP2Strategy``/``ContextParallelStrategy`` with ``cpu_offload`` and ``mixed_precision: bf16``), the chunked
loss, checkpointing with offloaded layer inputs, tiled MLPs, chunked RMSNorms (``ChunkedRMSNorm``), and the
sequence split over every GPU (context parallel size = GPUs), with Ulysses and with ring (all-gathered keys and values). The "TRL's setting" rows are
what TRL's long-context guide runs (bf16 weights and AdamW state sharded on the GPUs, no host offload of the
state, offloaded checkpoints, chunked loss, no tiled MLP, ring attention over every GPU), for the comparison
with its published 63.6 GB (4 GPUs) and 56.2 GB (8 GPUs), with each method, and once with tiled MLPs added.

Run::

    python benchmarks/planner_per_rank.py            # the whole table, ~15 s of CPU per row
    python benchmarks/planner_per_rank.py --models qwen3-8b --gpus 4 --methods ulysses
    python benchmarks/planner_per_rank.py --no-trl --hf-rms-norm   # the rows without ChunkedRMSNorm
"""

from __future__ import annotations

import argparse
import time

GIB = 2**30
TOKENS = 1_048_576
GPU_GIB = 80.0
CHECKPOINTING = "lit_memtrain.callbacks.GradientCheckpointing"
TILED_MLP = "lit_memtrain.callbacks.TiledMLP"
CHUNKED_RMS_NORM = "lit_memtrain.callbacks.ChunkedRMSNorm"


SETTINGS = {"every": "every technique", "trl": "TRL's setting", "trl_tiled": "TRL's setting + tiled MLP"}


def _settings(model: str, gpus: int, method: str, setting: str, hf_rms_norm: bool = False):
    from lit_memtrain.planner.settings import CallbackSpec, PlanSettings, StrategySpec

    trl = setting != "every"
    callbacks = [CallbackSpec(CHECKPOINTING, {"offload": True})]
    if setting != "trl":
        callbacks.append(CallbackSpec(TILED_MLP))
    if setting == "every" and not hf_rms_norm:
        callbacks.append(CallbackSpec(CHUNKED_RMS_NORM))
    strategy = StrategySpec(
        "ContextParallelStrategy",
        gpus,
        "context_parallel",
        mixed_precision=None if trl else "bf16",
        cpu_offload=not trl,
        context_parallel_size=gpus,
        context_parallel_method=method,
    )
    module = {"preset": model, "dtype": "bfloat16" if trl else "float32", "loss_type": "chunked"}
    return PlanSettings(
        module=module,
        precision="bf16-true" if trl else "32-true",
        callbacks=tuple(callbacks),
        max_length=TOKENS,
        padding_free=True,
        strategy=strategy,
        tokenizer=None,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["qwen3-8b", "qwen3-4b"])
    parser.add_argument("--gpus", nargs="+", type=int, default=[2, 4, 8])
    parser.add_argument("--methods", nargs="+", default=["ulysses", "ring"])
    parser.add_argument("--no-trl", action="store_true", help="leave out the rows in TRL's setting")
    parser.add_argument(
        "--hf-rms-norm", action="store_true", help="every technique but ChunkedRMSNorm (the table's 'before' column)"
    )
    args = parser.parse_args()

    from lit_memtrain.planner.simulate import stand_in_device

    stand_in_device()  # before anything in this process runs autograd
    from lit_memtrain.planner.step import simulate_fit_step

    rows = [(model, gpus, method, "every") for model in args.models for gpus in args.gpus for method in args.methods]
    if not args.no_trl and "qwen3-8b" in args.models:
        rows += [("qwen3-8b", gpus, method, "trl") for gpus in (4, 8) if gpus in args.gpus for method in args.methods]
        rows += [("qwen3-8b", 4, "ulysses", "trl_tiled")] if 4 in args.gpus and "ulysses" in args.methods else []
    usable = GPU_GIB * 0.9
    print(f"| model | setting | GPUs (= cp) | method | tokens per rank | peak per rank | phase | host per rank | "
          f"fits 80 GiB ({usable:.0f} usable) | CPU s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for model, gpus, method, setting in rows:
        start = time.process_time()
        step = simulate_fit_step(_settings(model, gpus, method, setting, args.hf_rms_norm))
        seconds = time.process_time() - start
        memory = step.memory
        peak, host = memory.device_peak / GIB, memory.host_peak / GIB
        fits = "yes" if peak <= usable else "no"
        print(f"| {model} | {SETTINGS[setting]} | {gpus} | {method} | {TOKENS // gpus:,} | {peak:.2f} GiB | "
              f"{memory.phase} | {host:.1f} GiB | {fits} | {seconds:.0f} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
