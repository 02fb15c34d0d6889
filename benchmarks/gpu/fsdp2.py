"""GPU check: FSDP2Strategy on one GPU with and without cpu_offload, peak memory and step time side by side.

A Qwen3-4B-shaped model (hidden 2560, MLP 9728, vocabulary 151,936) with fewer layers and random fp32
weights is trained for a few steps by ``Trainer(strategy=FSDP2Strategy(mixed_precision="bf16",
cpu_offload=...))`` on one sequence per step, with the chunked loss, checkpointing, tiled MLPs and gradient
clipping (``gradient_clip_val=1.0``): first with the sharded state on the GPU, then with it in host memory (the
optimizer steps on the CPU), each isolated from the other (``results.run_isolated``: in one process without
its proof, the first GPU run's first module, gradients and AdamW state stayed alive through the second, held by
its callback, whose ``log`` Lightning sets to the module's), on the same weights and tokens. Measured after a warm-up
step: peak allocated memory (``torch.cuda.max_memory_allocated``), the memory held between steps (parameters,
gradients and AdamW state when they live on the GPU), and the median step time. Checks: the first loss is the
same either way; clipping runs with ``cpu_offload`` (its gradient norm is a host tensor, reduced over the gloo
half of the ``cuda:nccl,cpu:gloo`` process group) and clips the first step's gradients as on the GPU; and with
``cpu_offload`` the memory held between steps is under a tenth of what it is without.

Run from the repository root (about a minute on one H200)::

    PYTHONPATH=. python benchmarks/gpu/fsdp2.py --json fsdp2.json
    PYTHONPATH=. python benchmarks/gpu/fsdp2.py --dry-run          # tiny shapes on the CPU
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

from lit_memtrain.techniques.allocator import enable_expandable_segments

enable_expandable_segments()

import torch  # noqa: E402
from lightning.pytorch import Callback, Trainer  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lit_memtrain.callbacks import GradientCheckpointing, TiledMLP  # noqa: E402
from lit_memtrain.objectives.causal_lm import CausalLMModule  # noqa: E402
from lit_memtrain.strategies import FSDP2Strategy  # noqa: E402
from results import add_arguments, run_isolated, table, watch, write  # noqa: E402

GIB = 2**30
CLIP = 1.0


def gradient_norm(module: torch.nn.Module) -> float:
    """The gradients' total norm as ``clip_grad_norm_`` computes it: over every rank's shards, with
    ``cpu_offload`` by a collective over host tensors."""
    norm = torch.nn.utils.get_total_norm([p.grad for p in module.parameters() if p.grad is not None])
    return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)


class Measure(Callback):
    """Step times, the peak of the steps after the warm-up, and the memory held when each step starts."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.losses: list[float] = []
        self.held: list[int] = []
        self.grad_norms: list[float] = []  # the first step's, before and after clipping
        self.peak = 0
        self._started = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize()
            self.held.append(torch.cuda.memory_allocated())
            if batch_idx == 1:  # after the warm-up step: kernels, allocator segments, AdamW state
                torch.cuda.reset_peak_memory_stats()
        self._started = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated()
        self.times.append(time.perf_counter() - self._started)
        self.losses.append(pl_module.last_train_loss)
        if batch_idx == 0:  # the gradients stay until the next step's backward
            self.grad_norms.append(gradient_norm(pl_module))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.global_step == 0:  # Lightning clips right after this hook
            self.grad_norms.append(gradient_norm(pl_module))


def measured(measure: Measure) -> dict[str, Any]:
    """What a :class:`Measure` holds, without the callback itself (whose ``log`` is its module's)."""
    names = ("times", "losses", "held", "grad_norms", "peak")
    return {name: value for name, value in vars(measure).items() if name in names}


def run(cpu_offload: bool, args: argparse.Namespace) -> dict[str, Any]:
    """One training run: the figures of its :class:`Measure`."""
    measure = Measure()
    vocab = 512 if args.dry_run else 151_936
    rows = torch.randint(0, vocab, (args.steps, args.seq_len), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    module = CausalLMModule(
        preset=args.preset, config_overrides={"num_hidden_layers": args.layers}, loss_chunk_size=4096,
        learning_rate=1e-5, attn_implementation="sdpa",
    )
    watch(module, after_collection=True)  # Lightning's trainer refers to itself: freed by the collector
    trainer = Trainer(
        accelerator="cpu" if args.dry_run else "gpu", devices=1, max_steps=args.steps, gradient_clip_val=CLIP,
        strategy=FSDP2Strategy(mixed_precision="bf16", cpu_offload=cpu_offload),
        callbacks=[GradientCheckpointing(offload=True), TiledMLP(), measure],
        logger=False, enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
    )
    batches = [{"input_ids": row[None], "labels": row[None].clone()} for row in rows]
    trainer.fit(module, DataLoader(batches, batch_size=None))
    return measured(measure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, default=32768)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4, help="including one warm-up step")
    parser.add_argument("--preset", default="qwen3-4b")
    add_arguments(parser)
    args = parser.parse_args()
    if args.dry_run:
        args.preset, args.seq_len, args.layers, args.steps = "tiny-qwen3", 64, 2, 3
    elif not torch.cuda.is_available():
        sys.exit("benchmarks/gpu/fsdp2.py needs a CUDA GPU and none is available: nothing was measured.")
    device = "cpu (dry run)" if args.dry_run else "CUDA GPU"
    print(f"{device}, each run isolated from the other, torch {torch.__version__}, {args.preset} with {args.layers} "
          f"layers, fp32 master weights, bf16 compute, {args.seq_len} tokens per step, chunked loss, offloaded "
          "checkpoints, tiled MLP", flush=True)
    results = {
        name: argparse.Namespace(**run_isolated(run, cpu_offload, args))
        for name, cpu_offload in (("on the GPU", False), ("cpu_offload", True))
    }

    reference = results["on the GPU"]
    columns = ["setting", "peak GiB", "held between steps GiB", "step s", "peak ratio", "time ratio"]
    rows_out = []
    for name, measure in results.items():
        peak, held = measure.peak / GIB, (measure.held[-1] if measure.held else 0) / GIB
        seconds = statistics.median(measure.times[1:])
        rows_out.append([
            name, round(peak, 3), round(held, 3), round(seconds, 3),
            round(measure.peak / reference.peak, 3) if reference.peak else float("nan"),
            round(seconds / statistics.median(reference.times[1:]), 3),
        ])
    print(" | ".join(columns))
    for row in rows_out:
        print(" | ".join(str(value) for value in row))
    offload = results["cpu_offload"]
    loss_difference = abs(offload.losses[0] - reference.losses[0]) / abs(reference.losses[0])
    held_ratio = (offload.held[-1] / reference.held[-1]) if reference.held else 0.0
    (before, after), (reference_before, reference_after) = offload.grad_norms, reference.grad_norms
    clipped = abs(after - min(CLIP, before)) < 1e-3 * after and abs(after - reference_after) < 1e-3 * reference_after
    checks = [
        {"name": "the first loss is the same with cpu_offload", "passed": loss_difference < 1e-3,
         "detail": f"relative difference {loss_difference:.2e}"},
        {"name": "gradient clipping with cpu_offload clips as on the GPU", "passed": clipped,
         "detail": f"first step's gradient norm {before:.4g} -> {after:.4g} (on the GPU {reference_before:.4g} -> "
                   f"{reference_after:.4g}), gradient_clip_val={CLIP}"},
        {"name": "cpu_offload holds under a tenth of the memory between steps", "passed": args.dry_run or held_ratio < 0.1,
         "detail": f"held with / without: {held_ratio:.3f}"},
    ]
    for item in checks:
        print(f"{'PASS' if item['passed'] else 'FAIL'}: {item['name']} ({item['detail']})")
    passed = write(
        args.json,
        summary=f"FSDP2Strategy on one GPU, {args.preset} x {args.layers} layers, {args.seq_len} tokens: "
                f"peak {rows_out[0][1]} GiB on the GPU, {rows_out[1][1]} GiB with cpu_offload",
        tables=[table("FSDP2Strategy, one GPU, with and without cpu_offload", columns, rows_out)],
        checks=checks,
        config={"seq_len": args.seq_len, "layers": args.layers, "steps": args.steps, "preset": args.preset},
    )
    if not passed:
        sys.exit(1)

if __name__ == "__main__":
    main()
