"""GPU check part: where a training step of the Qwen3-0.6B fit spends its time, its tokens/s and MFU, TRL's
SFTTrainer on the same model, data and options, and the fit's measured peak memory next to ``plan``'s.

The fit of the first GPU run (docs/benchmarks.md, design.md "Facts from the first GPU run"): a random Qwen3-0.6B
(vocabulary 151,936, tied head), bf16-true, rows of 16,384 tokens packed padding-free from documents of
lognormal lengths (median 150, about 165 on average), one row per step, no checkpointing, chunked loss, the
module's fused AdamW, gradient clipping at 1.0, attention as ``fit`` chooses it on the device
(``varlen_by_document`` on CUDA). It ran 43,700 tokens/s there, 15.8% MFU; the target is 35%.

Each setting is isolated from the others (``run_isolated``: in this process once proven clean, the plan in a
fresh one), so none measures what another left alive:

- ``plan``: the planner's predicted peak for the same fit arguments (``settings_from_config`` with the
  module, data and trainer arguments below, as ``lit-memtrain plan`` reads them), with the attention the plan
  assumed. Runs on the CPU.
- ``ours``: ``Trainer.fit`` of :class:`~lit_memtrain.objectives.causal_lm.CausalLMModule` on the packed rows
  (the ``PaddingFreeCollator`` batches the SFT datamodule makes, built here without ``datasets``), with the
  progress bar ``lit-memtrain fit`` adds (it reads the logged loss at each step: a device sync): a few
  warm-up steps, then timed steps (one device sync at each end), then one step under ``torch.profiler``.
  Reported: tokens/s, MFU (:func:`~lit_memtrain.objectives.throughput.training_flops` over the time, against
  :func:`~lit_memtrain.objectives.throughput.peak_flops`: 6 FLOPs per parameter and token plus attention), the
  MFU the module itself logged (``train/device/mfu``: none was logged on the H200 before), the peak allocated
  over the steps after the first (parameters, gradients and AdamW state all alive, what ``plan`` predicts).
- The profiled step, as shares of its wall time: GPU kernels in attention, in matrix products (outside the
  loss), in the chunked loss (everything under ``_ChunkedCrossEntropySum``, forward and backward: its head
  matmuls too), in the optimizer (AdamW's kernels and gradient clipping's norms, by name: Lightning runs the forward
  and backward inside ``Optimizer.step``), other kernels (norms, RoPE, activations,
  copies), and the time the GPU sat idle (host gaps: launch overhead, syncs, Python). On the CPU (dry run) the
  operators' own CPU time stands in for kernels, and the time outside any operator for the idle GPU. Then the
  twelve heaviest kernels by name, with their calls and time a call (a few long ones, or many short ones that
  launches bound).
- ``trl``: TRL's ``SFTTrainer`` (``packing=True``, bfd, padding-free, the attention ours runs (TRL passes the
  documents' bounds; its default sdpa would mask a dense L x L block per layer), bf16, ``adamw_torch_fused``,
  ``max_grad_norm=1.0``, no checkpointing) on the same documents, pre-tokenized, through a JSON-lines file
  (``load_dataset("json")``: ``Dataset.from_dict`` fails to fingerprint under datasets 5.2 + dill 0.4.1 on
  Python 3.12). Without trl or datasets the row says so and the rest is reported.

Checked: ours ran and logged an MFU on a GPU whose peak is known; the measured peak is within ``--tolerance``
(5%) of the plan's. With ``--compile``: the timed steps run under ``torch.compiler.set_stance("fail_on_recompile")``,
so the tokens/s time the compiled layers, not the compiler (a recompilation the warm-up steps did not take, for a
shape or a number the CPU's attention never passes, would otherwise land in them unseen: it raises instead).

Run from the repository root (about 90 s on one H200; TRL needs its wheels, see docs/benchmarks.md)::

    PYTHONPATH=. python benchmarks/gpu/step_profile.py
    PYTHONPATH=. python benchmarks/gpu/step_profile.py --dry-run   # tiny model on the CPU, figures mean nothing
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from results import add_arguments, check, run_isolated, table, write

from lit_memtrain.techniques.allocator import ALLOC_CONF_VARIABLES, EXPANDABLE_SEGMENTS

# As `lit-memtrain fit` runs (its AllocatorSettings callback), for ours and TRL's fits alike: read when CUDA starts.
os.environ.update(dict.fromkeys(ALLOC_CONF_VARIABLES, EXPANDABLE_SEGMENTS))

GIB = 2**30
SHARES = ("attention", "matmul", "chunked loss", "optimizer", "other kernels", "GPU idle (host gaps)")


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    """What every process needs to build the same run, as plain values."""
    return {
        "preset": args.preset, "max_length": args.max_length, "rows": args.warmup_steps + args.steps + 1,
        "warmup_steps": args.warmup_steps, "steps": args.steps, "median_length": args.median_length,
        "device": "cpu" if args.dry_run else "cuda", "precision": "32-true" if args.dry_run else "bf16-true",
        "dtype": "float32" if args.dry_run else "bfloat16", "seed": 0, "compile": args.compile,
        # The dry run captures the graphs without inductor's code generation (a minute on 2 cores).
        "compile_backend": "aot_eager" if args.dry_run else "inductor",
    }  # fmt: skip


def fit_config(settings: dict[str, Any]) -> dict[str, Any]:
    """The fit's arguments as ``lit-memtrain fit`` / ``plan`` read them (model, data and trainer sections)."""
    return {
        "model": {"preset": settings["preset"], "dtype": settings["dtype"], "loss_type": "chunked"},
        "data": {"max_length": settings["max_length"], "batch_size": 1, "packing": True},
        "trainer": {"precision": settings["precision"], "gradient_clip_val": 1.0},
    }


def documents(settings: dict[str, Any]) -> list[list[int]]:
    """Token ids of lognormal-length documents (median ``median_length``, at least 8 tokens), enough for ``rows``
    full rows, from the model's whole vocabulary (``vocab_size`` where the settings name one). Each row cuts its last document and drops the rest of it (about
    half a document a row), so a tenth more tokens and one row more are drawn: with exactly ``rows`` rows' worth the
    first GPU run got 11 rows of 12 and never reached its profiled step."""
    import numpy as np

    from lit_memtrain.models.presets import build_config

    vocab = settings.get("vocab_size") or build_config(settings["preset"]).vocab_size
    generator = np.random.default_rng(settings["seed"])
    docs, total = [], 0
    while total < 1.1 * (settings["rows"] + 1) * settings["max_length"]:
        length = int(np.clip(generator.lognormal(math.log(settings["median_length"]), 0.6), 8, settings["max_length"]))
        docs.append(generator.integers(0, vocab, length).tolist())
        total += length
    return docs


def packed_batches(settings: dict[str, Any]) -> list[dict[str, Any]]:
    """Rows of exactly ``max_length`` tokens, documents in order (the last one of a row cut to fit), collated
    padding-free as the SFT datamodule's packed rows are."""
    from lit_memtrain.datamodules.padding_free import PaddingFreeCollator

    collate, rows, row, used = PaddingFreeCollator(), [], [], 0
    for ids in documents(settings):
        ids = ids[: settings["max_length"] - used]
        row.append({"input_ids": ids, "labels": ids})
        used += len(ids)
        if used == settings["max_length"]:
            rows.append(collate(row))
            row, used = [], 0
    if len(rows) < settings["rows"]:
        raise RuntimeError(f"{len(rows)} packed rows where {settings['rows']} are needed: draw more documents.")
    return rows[: settings["rows"]]


def plan_fit(settings: dict[str, Any]) -> dict[str, Any]:
    """The planner's peak for the fit's arguments (in a fresh process: the planner registers its stand-in device
    in the process it runs in)."""
    from lit_memtrain.planner.fit_config import settings_from_config
    from lit_memtrain.planner.plan import Planner, gpu_budget

    start = time.perf_counter()
    planner = Planner(settings_from_config(fit_config(settings)), gpu_budget(141.0), progress=lambda line: None)
    step = planner.simulate()
    return {
        "peak_gib": step.memory.device_peak / GIB, "attention": step.attention,
        "notes": list(step.notes), "seconds": time.perf_counter() - start,
    }  # fmt: skip


# Names of what the optimizer step runs (AdamW's fused or foreach kernels, gradient clipping's norms): the ``Optimizer.
# step#...`` range itself is no mark, since Lightning runs the forward and backward inside it (the closure).
OPTIMIZER_WORDS = ("adam", "_foreach_", "zero_grad", "clip_grad")
ATTENTION_WORDS = ("flash", "fmha", "varlen", "scaled_dot_product", "attention")
MATMUL_WORDS = ("gemm", "cutlass", "xmma", "nvjet", "cublas", "aten::mm", "aten::addmm", "aten::bmm", "matmul")


def classify(name: str, ancestors: list[str]) -> str:
    """The share of :data:`SHARES` a kernel (or, on the CPU, an operator) named ``name`` belongs to, given the
    names of the operators it ran under (innermost first): the chunked loss where it ran under it, else the
    innermost attention or optimizer mark, else a matrix product (by the kernel's name or its operator's)."""
    lowered = [n.lower() for n in (name, *ancestors)]
    if any("_chunkedcrossentropysum" in n for n in lowered):
        return "chunked loss"
    for n in lowered:
        if n.startswith("optimizer."):  # Optimizer.step#AdamW.step, Optimizer.zero_grad#...: see OPTIMIZER_WORDS
            continue
        if any(word in n for word in ATTENTION_WORDS):
            return "attention"
        if any(word in n for word in OPTIMIZER_WORDS):
            return "optimizer"
    if any(word in n for n in lowered[:2] for word in MATMUL_WORDS):
        return "matmul"
    return "other kernels"


def _is_operator(event: Any) -> bool:
    """A CPU event that is an operator, not a range around Python (``Optimizer.step#...``, whose own time is the
    host's: the dry run counts it with the time outside any operator)."""
    return event.device_type.name == "CPU" and not event.name.lower().startswith("optimizer.")


def _ancestors(event: Any) -> Iterator[str]:
    parent = event.cpu_parent
    while parent is not None:
        yield parent.name
        parent = parent.cpu_parent


def step_shares(events: list[Any], wall_us: float, on_gpu: bool) -> dict[str, float]:
    """Shares of ``wall_us`` per :data:`SHARES` from a profiler's events: GPU kernels (each under the operator that
    launched it) and the GPU's idle time, or on the CPU the operators' own time and the time outside them."""
    busy = dict.fromkeys(SHARES, 0.0)
    if on_gpu:
        for event in events:
            for kernel in getattr(event, "kernels", ()):
                busy[classify(kernel.name, [event.name, *_ancestors(event)])] += kernel.duration
        intervals = sorted((e.time_range.start, e.time_range.end) for e in events if e.device_type.name == "CUDA")
        covered, reach = 0.0, -math.inf
        for start, end in intervals:  # the union of kernel intervals: the GPU was busy then
            covered += max(0.0, end - max(start, reach))
            reach = max(reach, end)
        busy["GPU idle (host gaps)"] = max(0.0, wall_us - covered)
    else:
        for event in events:
            if _is_operator(event):
                busy[classify(event.name, list(_ancestors(event)))] += event.self_cpu_time_total
        busy["GPU idle (host gaps)"] = max(0.0, wall_us - sum(busy.values()))  # outside any operator
    return {name: value / wall_us for name, value in busy.items()}


def heaviest_kernels(events: list[Any], wall_us: float, on_gpu: bool, count: int = 12) -> list[list[Any]]:
    """The ``count`` kernels (on the CPU, operators) that took most of the profiled step, by name: their share of
    :data:`SHARES`, calls, milliseconds in all, microseconds a call and share of ``wall_us``. Why: a share says where
    the time went, this says which kernel and whether it is a few long ones (to make faster) or many short ones
    (launch-bound: to fuse, as compiled layers do)."""
    totals: dict[str, list[Any]] = {}
    for event in events:
        if on_gpu:
            launched = [(kernel.name, kernel.duration, [event.name, *_ancestors(event)])
                        for kernel in getattr(event, "kernels", ())]  # fmt: skip
        elif _is_operator(event):
            launched = [(event.name, event.self_cpu_time_total, list(_ancestors(event)))]
        else:
            launched = []
        for name, duration, ancestors in launched:
            row = totals.setdefault((name, classify(name, ancestors)), [0, 0.0])
            row[0] += 1
            row[1] += duration
    heaviest = sorted(totals.items(), key=lambda item: -item[1][1])[:count]
    return [[name if len(name) <= 90 else name[:87] + "...", share, calls, total / 1e3, total / calls,
             total / wall_us] for (name, share), (calls, total) in heaviest]  # fmt: skip


KERNEL_COLUMNS = ["kernel", "where", "calls", "ms", "us a call", "share of the step"]


def fit_ours(settings: dict[str, Any]) -> dict[str, Any]:
    """Train the fit with Lightning, time it, profile one step; the figures as a dict."""
    import torch
    from lightning.pytorch import Callback, Trainer
    from torch.profiler import ProfilerActivity, profile
    from torch.utils.data import DataLoader

    from lit_memtrain.callbacks import CompiledLayers
    from lit_memtrain.cli.progress import StepProgressBar
    from lit_memtrain.objectives.causal_lm import CausalLMModule
    from lit_memtrain.objectives.throughput import attention_pairs, count_tokens, peak_flops, training_flops

    torch.manual_seed(settings["seed"])
    batches = packed_batches(settings)
    cuda = settings["device"] == "cuda"
    warmup, steps = settings["warmup_steps"], settings["steps"]
    timed = batches[warmup : warmup + steps]

    def synchronize() -> None:
        if cuda:
            torch.cuda.synchronize()

    class Measure(Callback):
        """Times steps ``warmup`` to ``warmup + steps`` together, then profiles the one after."""

        def __init__(self) -> None:
            self.profiler: profile | None = None
            self.started_at = self.seconds = self.profiled_us = 0.0

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if batch_idx == 1 and cuda:
                torch.cuda.reset_peak_memory_stats()  # from the second step on: the steady state plan predicts
            if batch_idx == warmup:
                synchronize()
                # A timed step that compiled would time the compiler: the warm-up must take every compilation
                # (the first shapes, then the recompilation for a new document count), and one left raises here.
                torch.compiler.set_stance("fail_on_recompile")
                self.started_at = time.perf_counter()
            if batch_idx == warmup + steps:
                synchronize()
                self.seconds = time.perf_counter() - self.started_at
                torch.compiler.set_stance("default")
                activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
                self.profiler = profile(activities=activities)
                self.profiler.start()
                self.started_at = time.perf_counter()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if self.profiler is not None:
                synchronize()
                self.profiled_us = (time.perf_counter() - self.started_at) * 1e6
                self.profiler.stop()

    measure = Measure()
    compiled = [CompiledLayers(backend=settings["compile_backend"])] if settings["compile"] else []
    config = fit_config(settings)
    module = CausalLMModule(**config["model"], warmup=0.0, min_lr_ratio=1.0)
    trainer = Trainer(
        accelerator="gpu" if cuda else "cpu", devices=1, max_steps=len(batches), logger=False,
        enable_checkpointing=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
        log_every_n_steps=warmup + steps, callbacks=[measure, StepProgressBar()] + compiled, **config["trainer"],
    )  # fmt: skip
    try:
        trainer.fit(module, DataLoader(batches, batch_size=None))
    finally:
        torch.compiler.set_stance("default")  # where a compilation in the timed steps raised
    if measure.profiler is None:
        raise RuntimeError(f"the fit ended after {trainer.global_step} steps, before the profiled step {warmup + steps}")
    device = trainer.strategy.root_device
    tokens = sum(int(count_tokens(batch)) for batch in timed)
    flops = sum(training_flops(module.model, count_tokens(b), attention_pairs(b)) for b in timed)
    peak = peak_flops(device, torch.bfloat16 if cuda else torch.float32)
    parameters = sum(p.numel() for p in module.model.parameters())
    logged_mfu = trainer.callback_metrics.get("train/device/mfu")
    return {
        "attention": module.model.config._attn_implementation,
        "tokens_per_s": tokens / measure.seconds,
        "step_s": measure.seconds / steps,
        "mfu": flops / measure.seconds / peak if peak else math.nan,
        "mfu_6n": 6 * parameters * tokens / measure.seconds / peak if peak else math.nan,
        "logged_mfu": float(logged_mfu) if logged_mfu is not None else math.nan,
        "peak_gib": torch.cuda.max_memory_allocated() / GIB if cuda else math.nan,
        "profiled_step_s": measure.profiled_us / 1e6,
        "shares": step_shares(list(measure.profiler.events()), measure.profiled_us, cuda),
        "kernels": heaviest_kernels(list(measure.profiler.events()), measure.profiled_us, cuda),
        "tokens_per_step": tokens / steps,
    }


def fit_trl(settings: dict[str, Any], data_dir: str) -> dict[str, Any]:
    """TRL's SFTTrainer on the same documents; ``{"skipped": reason}`` without trl or datasets."""
    try:
        import trl  # before datasets, which it needs: the row names the first package missing
        import datasets
    except ImportError as error:
        return {"skipped": f"{error.name} missing"}
    import dataclasses

    import torch
    from transformers import AutoModelForCausalLM, TrainerCallback

    from lit_memtrain.datamodules.embedded import EMBEDDED
    from lit_memtrain.datamodules.tokenizer import load_tokenizer
    from lit_memtrain.models.presets import build_config
    from lit_memtrain.techniques.attention import choose_document_attention

    data = Path(data_dir) / "documents.jsonl"
    data.write_text("".join(json.dumps({"input_ids": ids}) + "\n" for ids in documents(settings)))
    datasets.disable_progress_bars()
    cuda = settings["device"] == "cuda"
    warmup, steps = settings["warmup_steps"], settings["steps"]
    marks: dict[str, float] = {}
    tokens: list[int] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == warmup:
                if cuda:
                    torch.cuda.synchronize()
                marks["start"] = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == warmup + steps:
                if cuda:
                    torch.cuda.synchronize()
                marks["end"] = time.perf_counter()

    class CountingTrainer(trl.SFTTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            tokens.append(int(inputs["input_ids"].numel()))
            return super().training_step(model, inputs, num_items_in_batch)

    torch.manual_seed(settings["seed"])
    dtype = getattr(torch, settings["dtype"])
    model = AutoModelForCausalLM.from_config(build_config(settings["preset"]), dtype=dtype, attn_implementation="sdpa")
    # The attention ours runs (the module's choice for the device): with transformers' sdpa a packed row gets a dense
    # L x L mask and a kernel that computes every cross-document block (about 100 times ours' attention at 16k tokens
    # of ~165-token documents), and the tokens/s would compare attention kernels, not the two trainers. TRL passes
    # the documents' bounds (cu_seq_lens_q), which the document attentions read.
    attention = choose_document_attention(model, torch.device(settings["device"]), half_precision=cuda)
    model.set_attn_implementation(attention)
    fields = {field.name for field in dataclasses.fields(trl.SFTConfig)}
    no_checkpointing = "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"
    config = trl.SFTConfig(
        output_dir=str(Path(data_dir) / "trl"), packing=True, packing_strategy="bfd", padding_free=True,
        max_length=settings["max_length"], per_device_train_batch_size=1, gradient_accumulation_steps=1,
        max_steps=warmup + steps, learning_rate=2e-5, lr_scheduler_type="constant", weight_decay=0.0,
        optim="adamw_torch_fused", max_grad_norm=1.0, bf16=cuda, use_cpu=not cuda, report_to=[],
        save_strategy="no", disable_tqdm=True, dataloader_num_workers=0, seed=settings["seed"],
        **{no_checkpointing: False},
    )  # fmt: skip
    dataset = datasets.load_dataset("json", data_files=str(data), split="train")
    trainer = CountingTrainer(model=model, args=config, train_dataset=dataset, processing_class=load_tokenizer(EMBEDDED),
                              callbacks=[Timer()])  # fmt: skip
    trainer.train()
    seconds = marks["end"] - marks["start"]
    timed = tokens[warmup : warmup + steps]
    ran = trainer.model.config._attn_implementation  # what TRL trained with, read as ours' is
    return {"trl": trl.__version__, "attention": ran, "tokens_per_s": sum(timed) / seconds, "step_s": seconds / steps,
            "tokens_per_step": sum(timed) / steps}  # fmt: skip


def compiled_only(args: argparse.Namespace, settings: dict[str, Any]) -> None:
    """``--compile``: the same fit with every decoder layer compiled (its warm-up steps take the compilation and the
    recompilation for a new document count), its speed and profiled step; the eager fit, TRL and the plan are the
    part without ``--compile``."""
    ours = run_isolated(fit_ours, settings, timeout_s=300)
    print(f"ours, compiled layers: {ours['tokens_per_s']:,.0f} tokens/s, MFU {ours['mfu']:.1%}, attention "
          f"{ours['attention']}, peak {ours['peak_gib']:.2f} GiB", flush=True)
    shares = ours["shares"]
    tables = [
        table(f"{args.preset}, {args.max_length:,}-token packed rows (median document {args.median_length}), batch 1, "
              f"{settings['precision']}, no checkpointing, chunked loss, fused AdamW, every decoder layer compiled "
              f"(CompiledLayers); {args.steps} timed steps after {args.warmup_steps} warm-up",
              ["run", "attention", "tokens/step", "s/step", "tokens/s", "MFU", "MFU (6N only)",
               "MFU logged by the module", "peak GiB"],
              [["lit-memtrain fit, compiled layers", ours["attention"], ours["tokens_per_step"], ours["step_s"],
                ours["tokens_per_s"], ours["mfu"], ours["mfu_6n"], ours["logged_mfu"], ours["peak_gib"]]]),
        table(f"One profiled step of ours, compiled ({ours['profiled_step_s']:.3f} s): share of its wall time",
              ["where", "share"], [[name, shares[name]] for name in SHARES]),
        table("Its heaviest kernels", KERNEL_COLUMNS, ours["kernels"]),
    ]  # fmt: skip
    checks = [] if args.dry_run else [
        check("ours, compiled, logged an MFU (train/device/mfu) on this GPU", not math.isnan(ours["logged_mfu"]),
              f"logged {ours['logged_mfu']:.3f}, measured here {ours['mfu']:.3f}"),
    ]  # fmt: skip
    summary = (f"compiled layers: {ours['tokens_per_s']:,.0f} tokens/s, MFU {ours['mfu']:.1%}, "
               f"peak {ours['peak_gib']:.2f} GiB")
    passed = write(args.json, summary=summary, tables=tables, checks=checks, config=settings)
    sys.exit(0 if passed else 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen3-0.6b")
    parser.add_argument("--max-length", type=int, default=16384, help="tokens per packed row")
    parser.add_argument("--median-length", type=int, default=150, help="median document length")
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8, help="timed steps (then one profiled step)")
    parser.add_argument("--tolerance", type=float, default=0.05, help="largest |measured / planned peak - 1|")
    parser.add_argument("--compile", action="store_true",
                        help="ours with CompiledLayers (torch.compile of each decoder layer) only: no plan, no TRL")
    add_arguments(parser)
    args = parser.parse_args()
    if args.dry_run:
        args.preset, args.max_length, args.median_length, args.warmup_steps, args.steps = "tiny-qwen3", 256, 20, 1, 2
        # Compiled, the second step recompiles for its new document count (dynamic from then on): one more warm-up
        # step, so the dry run's timed steps compile nothing either, as the check above asks of the GPU run.
        args.warmup_steps += args.compile
    else:
        import torch

        if not torch.cuda.is_available():
            sys.exit("benchmarks/gpu/step_profile.py needs a CUDA GPU and none is available: nothing was measured.")
    settings = _settings(args)
    if args.compile:
        compiled_only(args, settings)
        return
    plan = run_isolated(plan_fit, settings, timeout_s=120, fresh=True)  # the planner's stand-in device
    print(f"plan: {plan['peak_gib']:.2f} GiB, attention {plan['attention']}", flush=True)
    # TRL first: ours ends with a torch.profiler step, and neither timing may follow a profiler in the same process.
    with tempfile.TemporaryDirectory(prefix="step_profile_") as directory:
        trl_run = run_isolated(fit_trl, settings, directory, timeout_s=120)
    print(f"trl: {trl_run}", flush=True)
    ours = run_isolated(fit_ours, settings, timeout_s=120)
    print(f"ours: {ours['tokens_per_s']:,.0f} tokens/s, MFU {ours['mfu']:.1%}, attention {ours['attention']}, "
          f"peak {ours['peak_gib']:.2f} GiB", flush=True)

    speed_rows = [["lit-memtrain fit", ours["attention"], ours["tokens_per_step"], ours["step_s"],
                   ours["tokens_per_s"], 1.0, ours["mfu"], ours["mfu_6n"], ours["logged_mfu"]]]  # fmt: skip
    if "skipped" in trl_run:
        speed_rows.append([f"TRL SFTTrainer (skipped: {trl_run['skipped']})", "n/a"] + [math.nan] * 7)
    else:
        speed_rows.append([f"TRL {trl_run['trl']} SFTTrainer", trl_run["attention"], trl_run["tokens_per_step"],
                           trl_run["step_s"],
                           trl_run["tokens_per_s"], trl_run["tokens_per_s"] / ours["tokens_per_s"]]
                          + [math.nan] * 3)  # fmt: skip
    shares = ours["shares"]
    ratio = ours["peak_gib"] / plan["peak_gib"]
    tables = [
        table(f"{args.preset}, {args.max_length:,}-token packed rows (median document {args.median_length}), batch 1, "
              f"{settings['precision']}, no checkpointing, chunked loss, fused AdamW; {args.steps} timed steps after "
              f"{args.warmup_steps} warm-up", ["run", "attention", "tokens/step", "s/step", "tokens/s",
              "tokens/s vs ours", "MFU", "MFU (6N only)", "MFU logged by the module"], speed_rows),
        table(f"One profiled step of ours ({ours['profiled_step_s']:.3f} s): share of its wall time",
              ["where", "share"], [[name, shares[name]] for name in SHARES]),
        table("Its heaviest kernels", KERNEL_COLUMNS, ours["kernels"]),
        table("The fit's peak device memory (from its second step) against `plan` with the same arguments",
              ["planned GiB", "attention planned", "measured GiB", "attention run", "measured / planned"],
              [[plan["peak_gib"], plan["attention"], ours["peak_gib"], ours["attention"], ratio]]),
    ]  # fmt: skip
    checks = []
    if not args.dry_run:
        checks = [
            check("ours logged an MFU (train/device/mfu) on this GPU", not math.isnan(ours["logged_mfu"]),
                  f"logged {ours['logged_mfu']:.3f}, measured here {ours['mfu']:.3f}"),
            check(f"measured peak within {args.tolerance:.0%} of the plan's", abs(ratio - 1) <= args.tolerance,
                  f"measured / planned {ratio:.3f}"),
            check("the plan assumed the attention the fit chose", plan["attention"] == ours["attention"],
                  f"plan {plan['attention']}, fit {ours['attention']}"),
        ]  # fmt: skip
    if "skipped" not in trl_run:  # the dry run too, where trl is installed
        checks.append(check("TRL ran the attention ours ran", trl_run["attention"] == ours["attention"],
                            f"TRL {trl_run['attention']}, ours {ours['attention']}"))
    summary = (f"ours {ours['tokens_per_s']:,.0f} tokens/s, MFU {ours['mfu']:.1%}; "
               + (f"TRL {trl_run['tokens_per_s']:,.0f}" if "skipped" not in trl_run else f"TRL {trl_run['skipped']}")
               + f"; peak measured / planned {ratio:.3f}")  # fmt: skip
    passed = write(args.json, summary=summary, tables=tables, checks=checks, config=settings | {"plan": plan})
    for item in checks:
        print(f"{'passed' if item['passed'] else 'FAILED'}: {item['name']} ({item['detail']})")
    sys.exit(0 if passed else 1)


if __name__ == "__main__":
    main()
