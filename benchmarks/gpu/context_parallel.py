"""GPU check: ContextParallelStrategy against FSDP2Strategy on one GPU, peak memory and step time side by side.

A Qwen3-4B-shaped model (hidden 2560, 32 query / 8 key-value heads, vocabulary 151,936) with few layers and
random fp32 weights trains a few steps on one row per step (bf16 compute, chunked loss, offloaded checkpoints,
tiled MLP), on the same weights and tokens in every set-up:

- On one GPU (the context-parallel split needs two): ``ContextParallelStrategy(context_parallel_size=1)``
  against ``FSDP2Strategy``. The single-rank path must add no cost: same first loss, same peak, step time within
  5%. The multi-GPU part is skipped with a message.
- On N >= 2 GPUs: additionally the row split over N ranks (``method``, Ulysses by default), ranks spawned here.
  Checks: the first loss equals one GPU's within bf16 rounding, and each rank's peak is below one GPU's.

Measured after a warm-up step: peak allocated memory (the largest over the ranks) and the median step time, the
one-rank figures against FSDP2's run after ``ContextParallelStrategy(1)`` (a first FSDP2 run warms the process:
measured first, a strategy would be timed against the warm-up of the other).
Each one-rank run is isolated from the other (``results.run_isolated``: in this process once proven clean):
run after FSDP2 in the same process without that proof, ``ContextParallelStrategy(1)`` measured FSDP2's module,
gradients and AdamW state too (kept alive by its callback). The ranks of the split are processes of their own.

Run from the repository root::

    PYTHONPATH=. python benchmarks/gpu/context_parallel.py --json context_parallel.json
    PYTHONPATH=. python benchmarks/gpu/context_parallel.py --method ring --seq-len 65536
    PYTHONPATH=. python benchmarks/gpu/context_parallel.py --dry-run   # tiny shapes, 1 and 2 CPU ranks
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

from lit_memtrain.techniques.allocator import enable_expandable_segments

enable_expandable_segments()

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from lightning.fabric.plugins.environments.lightning import find_free_network_port  # noqa: E402
from lightning.pytorch import Trainer  # noqa: E402
from lightning.pytorch.strategies import Strategy  # noqa: E402
import fsdp2  # noqa: E402
from results import add_arguments, check, run_isolated, table, watch, write  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lit_memtrain.callbacks import GradientCheckpointing, TiledMLP  # noqa: E402
from lit_memtrain.objectives.causal_lm import CausalLMModule  # noqa: E402
from lit_memtrain.strategies import ContextParallelStrategy, FSDP2Strategy  # noqa: E402

GIB = 2**30


class Measure(fsdp2.Measure):
    """FSDP2's measurement, its peak the largest over the ranks; ``losses`` are whole-row means on every rank."""

    def on_train_end(self, trainer, pl_module) -> None:
        self.peak = int(trainer.strategy.reduce(torch.tensor(self.peak, device=pl_module.device), reduce_op="max"))


def run(strategy: Strategy, devices: int, args: argparse.Namespace) -> Measure:
    measure = Measure()
    torch.manual_seed(0)
    module = CausalLMModule(
        preset=args.preset, config_overrides={"num_hidden_layers": args.layers}, loss_chunk_size=4096,
        learning_rate=1e-5, attn_implementation="sdpa",
    )  # fmt: skip
    watch(module, after_collection=True)  # Lightning's trainer refers to itself: freed by the collector
    trainer = Trainer(
        accelerator="cpu" if args.dry_run else "gpu", devices=devices, max_steps=args.steps, strategy=strategy,
        callbacks=[GradientCheckpointing(offload=True), TiledMLP(), measure], use_distributed_sampler=False,
        logger=False, enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
    )  # fmt: skip
    vocab = 512 if args.dry_run else 151_936
    rows = torch.randint(0, vocab, (args.steps, args.seq_len), generator=torch.Generator().manual_seed(1))
    trainer.fit(module, DataLoader([{"input_ids": row[None], "labels": row[None].clone()} for row in rows], batch_size=None))
    return measure


def one_rank(strategy: str, args: argparse.Namespace) -> argparse.Namespace:
    """A one-rank run (``"fsdp2"`` or ``"context parallel"``): its measured figures."""
    if strategy == "fsdp2":
        measure = run(FSDP2Strategy(mixed_precision="bf16"), 1, args)
    else:
        measure = run(ContextParallelStrategy(1, mixed_precision="bf16"), 1, args)
    return argparse.Namespace(**fsdp2.measured(measure))


def split_worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    """One rank of the context-parallel run (started by :func:`split_run`); rank 0 writes the measurement."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), NODE_RANK="0",
                      LOCAL_RANK=str(rank))  # fmt: skip
    if args.dry_run:
        torch.set_num_threads(1)
    strategy = ContextParallelStrategy(world, method=args.method, ring_backend=args.ring_backend, mixed_precision="bf16")
    measure = run(strategy, world, args)
    if rank == 0:
        torch.save({"times": measure.times, "losses": measure.losses, "peak": measure.peak}, out)


def split_run(world: int, args: argparse.Namespace) -> Measure:
    """Run the ranks of the split. On GPUs they are spawned (a forked child cannot use CUDA); the CPU ranks of a
    dry run are forked, so they do not import torch and Lightning again (most of a dry run's time)."""
    with tempfile.TemporaryDirectory() as directory:
        out = str(Path(directory) / "split.pt")
        mp.start_processes(split_worker, args=(world, find_free_network_port(), args, out), nprocs=world,
                           start_method="fork" if args.dry_run else "spawn")  # fmt: skip
        measure = Measure()
        vars(measure).update(torch.load(out, weights_only=True))
        return measure


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, default=16384)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4, help="including one warm-up step")
    parser.add_argument("--preset", default="qwen3-4b")
    parser.add_argument("--method", choices=("ulysses", "ring"), default="ulysses")
    parser.add_argument("--ring-backend", choices=("all_gather", "torch"), default="torch")
    add_arguments(parser)
    args = parser.parse_args()
    if args.method == "ulysses":
        args.ring_backend = "all_gather"  # unused by Ulysses
    if args.dry_run:
        args.preset, args.seq_len, args.layers, args.steps = "tiny-qwen3", 64, 2, 3
        args.ring_backend = "all_gather"
        world = 2  # two CPU ranks: the multi-rank code path runs too
    elif not torch.cuda.is_available():
        sys.exit("benchmarks/gpu/context_parallel.py needs a CUDA GPU and none is available: nothing was measured.")
    else:
        world = torch.cuda.device_count()
    device = "cpu (dry run)" if args.dry_run else f"{world} CUDA GPU(s)"  # this process leaves CUDA to its children
    print(f"{device}, torch {torch.__version__}, {args.preset} with {args.layers} layers, bf16 compute, "
          f"{args.seq_len} tokens per step, chunked loss, offloaded checkpoints, tiled MLP", flush=True)  # fmt: skip

    # The split runs first: its ranks are spawned before this process has touched CUDA.
    split = split_run(world, args) if world >= 2 else None
    # FSDP2 before and after: the first fit of the process also warms it (kernels loaded, cuBLAS's choices made) for
    # whatever runs next, so the reference is the run after ContextParallelStrategy(1): the order cannot hide a cost.
    results = {
        "FSDP2Strategy, 1 rank, first (warms the process)": run_isolated(one_rank, "fsdp2", args),
        "ContextParallelStrategy(1), 1 rank": run_isolated(one_rank, "context parallel", args),
        "FSDP2Strategy, 1 rank": run_isolated(one_rank, "fsdp2", args),
    }
    if split is not None:
        results[f"ContextParallelStrategy({world}, {args.method}), {world} ranks"] = split
    else:
        print(f"SKIP: the context-parallel split needs 2 GPUs, found {world}: only the single-rank path is measured.")

    reference = results["FSDP2Strategy, 1 rank"]
    base_seconds = statistics.median(reference.times[1:])
    columns = ["setting", "peak GiB per rank", "step s", "peak ratio", "time ratio", "first loss"]
    rows = [
        [name, round(measure.peak / GIB, 3), round(statistics.median(measure.times[1:]), 3),
         round(measure.peak / reference.peak, 3) if reference.peak else float("nan"),
         round(statistics.median(measure.times[1:]) / base_seconds, 3), round(measure.losses[0], 5)]
        for name, measure in results.items()
    ]  # fmt: skip
    print(" | ".join(columns))
    for row in rows:
        print(" | ".join(str(value) for value in row))

    single = results["ContextParallelStrategy(1), 1 rank"]
    time_ratio = statistics.median(single.times[1:]) / base_seconds
    checks = [
        check("context_parallel_size=1 gives FSDP2's first loss", single.losses[0] == reference.losses[0],
              f"{single.losses[0]:.6f} vs {reference.losses[0]:.6f}"),
        check("context_parallel_size=1 adds no memory", single.peak <= reference.peak * 1.001,
              f"peak ratio {single.peak / reference.peak:.4f}" if reference.peak else "not measured (CPU)"),
        check("context_parallel_size=1 adds no time (within 5%)", args.dry_run or time_ratio < 1.05,
              f"time ratio {time_ratio:.3f}"),
    ]  # fmt: skip
    if split is not None:
        difference = abs(split.losses[0] - reference.losses[0]) / abs(reference.losses[0])
        checks.append(check(f"the first loss split over {world} ranks is one rank's (bf16)", difference < 1e-2,
                            f"relative difference {difference:.2e}"))  # fmt: skip
        checks.append(check(f"each of {world} ranks peaks below one rank", args.dry_run or split.peak < reference.peak,
                            f"peak ratio {split.peak / reference.peak:.3f}" if reference.peak else "not measured"))  # fmt: skip
    for item in checks:
        print(f"{'PASS' if item['passed'] else 'FAIL'}: {item['name']} ({item['detail']})")
    summary = (f"{args.preset} x {args.layers} layers, {args.seq_len} tokens: cp 1 time ratio {time_ratio:.3f} vs FSDP2"
               + (f"; split over {world} ranks: peak ratio {rows[-1][3]}, time ratio {rows[-1][4]}" if split else
                  f"; split skipped ({world} GPU)"))  # fmt: skip
    passed = write(
        args.json, summary=summary, checks=checks,
        tables=[table("ContextParallelStrategy against FSDP2Strategy on one rank", columns, rows)],
        config={"seq_len": args.seq_len, "layers": args.layers, "steps": args.steps, "preset": args.preset,
                "method": args.method, "ring_backend": args.ring_backend, "ranks": world},
    )  # fmt: skip
    if not passed:
        sys.exit(1)


if __name__ == "__main__":
    main()
