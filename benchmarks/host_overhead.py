"""Host time per training step of the Qwen3-0.6B packed fit, on the CPU: ``lit-memtrain fit``'s stack against a
plain PyTorch loop on the same model and rows, side by side, and where our stack's time goes.

Why: on one H200 the fit of ``benchmarks/gpu/step_profile.py`` (a random Qwen3-0.6B, bf16-true, 16,384-token packed
padding-free rows of ~165-token documents, batch 1, no checkpointing, chunked loss, fused AdamW, gradient clipping
at 1.0, ``varlen_by_document`` attention) ran about 375 ms a step where its matrix products need 60-80 ms. Python
that runs each step (our module, callbacks, step-token wrapper, throughput meter, attention bounds; Lightning's loop,
logging and progress bar; transformers' mask building) leaves the GPU idle wherever it is not hidden behind queued
kernels. That host time can be measured without a GPU: the same fit, with a model of the same structure (Qwen3, 28
decoder layers, twice as many query heads as key/value heads, tied head) but a tiny width and vocabulary, so that the
arithmetic costs little, on rows packed exactly as step_profile packs them (its ``documents``, lognormal lengths of
median 150, ids folded into the tiny vocabulary).

- ``ours``: ``Trainer.fit`` of ``CausalLMModule`` as step_profile runs it (the same module options, precision, clip,
  ``StepProgressBar``), ``attn_implementation="varlen_by_document"``; a second ``ours`` row logs every step to a
  ``CSVLogger`` (``log_every_n_steps=1``), the most a ``lit-memtrain fit`` logs.
- ``plain``: the floor for that model: a loop of the decoder body, the chunked loss, backward, clip, AdamW and the
  schedule (the module's own ``optimizer_and_schedule``) on the same batches, nothing else.

CUDA's ``varlen_attn`` does not run on the CPU: both runs use a stand-in with its signature (``q + k + v``: one
cheap operator per layer where the GPU launches one kernel), so the host path through our attention (bounds read
per layer, checked once per row, grouped heads repeated) is the one the GPU run takes. A step's time is between
the starts of consecutive batches (Lightning's whole loop included), in this process's CPU time (the machine may be
shared: a step that waits for a core does not count the wait), its lead-in (from the end of the step before, where
the bar reads the loss and a GPU has drained, to the first decoder layer: the host time a GPU waits for) and the
forward through the layers; medians over every round's timed steps, each round running the runs in another order.
The same pair on each row's first 512 tokens measures our stack's time with little arithmetic around it. Then the
next steps of each run under ``cProfile`` (its own overhead inflates Python; read shares, not times): the top
entries by cumulative and own time, and own time summed by package. Checked: ours and the plain loop compute the
same losses; ``--save`` / ``--compare`` check a change of ours against the losses and weights before it.

Run from the repository root (about 50 s on 2 cores)::

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/host_overhead.py
    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/host_overhead.py --save before.pt  # then --compare before.pt
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import itertools
import os
import pstats
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent / "gpu"))  # step_profile's documents and packing

import torch  # noqa: E402

from step_profile import packed_batches  # noqa: E402

TINY = {
    "hidden_size": 4, "intermediate_size": 8, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 2,
    "vocab_size": 256,
}  # fmt: skip


def install_varlen_stand_in() -> None:
    """Make ``varlen_by_document`` take its CUDA path on the CPU, with a stand-in for torch's ``varlen_attn`` (as
    the attention tests do); torch 2.11's GPU build takes no ``enable_gqa``, so key/value heads are repeated."""
    from lit_memtrain.techniques import attention

    def varlen_attn(query, key, value, cu_q, cu_k, max_q, max_k, *, scale=None, is_causal=True):  # noqa: ARG001
        return query + key + value

    attention._VARLEN_KERNEL = (varlen_attn, {"is_causal": True}, False)
    attention._varlen_runs = lambda query, dropout: True


def module_arguments(settings: dict[str, Any]) -> dict[str, Any]:
    return {
        "preset": settings["preset"], "config_overrides": TINY, "dtype": settings["dtype"], "loss_type": "chunked",
        "attn_implementation": "varlen_by_document", "warmup": 0.0, "min_lr_ratio": 1.0,
    }  # fmt: skip


class StepClock:
    """Each batch's start time, its step's end (the loss computed, gradients applied: where ``lit-memtrain fit``'s
    progress bar then reads the loss, a device sync), when its first decoder layer starts, and cProfile over the
    batches from ``profile_from`` on."""

    def __init__(self, profile_from: int) -> None:
        self.starts: list[float] = []  # this process's CPU time: the machine is shared, a step may wait for a core
        self.wall: list[float] = []
        self.ends: list[float] = []
        self.first_layer: dict[int, float] = {}  # by batch: its last forward (a setup probe runs one before)
        self.last_layer: dict[int, float] = {}
        self.profile_from = profile_from
        self.profiler = cProfile.Profile()

    def watch(self, model: torch.nn.Module) -> None:
        from lit_memtrain.models.layers import find_decoder_layers

        def started(*_: Any) -> None:
            self.first_layer[len(self.starts) - 1] = time.process_time()

        def ended(*_: Any) -> None:
            self.last_layer[len(self.starts) - 1] = time.process_time()

        layers = find_decoder_layers(model)
        layers[0].register_forward_pre_hook(started)
        layers[-1].register_forward_hook(ended)

    def batch_start(self, index: int) -> None:
        self.starts.append(time.process_time())
        self.wall.append(time.perf_counter())
        if index == self.profile_from:
            self.profiler.enable()

    def batch_end(self) -> None:
        self.ends.append(time.process_time())

    def end(self) -> None:
        self.starts.append(time.process_time())
        self.wall.append(time.perf_counter())
        self.profiler.disable()

    def step_ms(self, first: int, last: int, wall: bool = False) -> list[float]:
        marks = self.wall if wall else self.starts
        return [(b - a) * 1e3 for a, b in zip(marks[first:last], marks[first + 1 : last + 1])]

    def lead_in_ms(self, first: int, last: int) -> list[float]:
        """From the end of the step before to this step's first decoder layer: Lightning's loop, the next batch,
        the hooks, the embedding and transformers' mask building; a GPU drained by the previous step's loss read
        has nothing to run meanwhile."""
        return [(self.first_layer[i] - self.ends[i - 1]) * 1e3 for i in range(first, last)]

    def layers_ms(self, first: int, last: int) -> list[float]:
        """From the first decoder layer's start to the last one's end: the forward through the layers."""
        return [(self.last_layer[i] - self.first_layer[i]) * 1e3 for i in range(first, last)]


def fit_ours(settings: dict[str, Any], batches: list[dict[str, Any]], log_every_step: bool) -> dict[str, Any]:
    """``Trainer.fit`` of the module as step_profile runs it; per-step times, losses, final weights, profile."""
    from lightning.pytorch import Callback, Trainer
    from lightning.pytorch.loggers import CSVLogger
    from torch.utils.data import DataLoader

    from lit_memtrain.cli.progress import StepProgressBar
    from lit_memtrain.objectives.causal_lm import CausalLMModule

    clock, losses = StepClock(settings["warmup"] + settings["steps"]), []

    class Clock(Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            clock.batch_start(batch_idx)

        def on_train_start(self, trainer, module):
            clock.watch(module.model)

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            clock.batch_end()  # before the progress bar (the next callback) reads the loss
            losses.append(outputs["loss"].detach().clone())

        def on_train_end(self, trainer, module):
            clock.end()

    torch.manual_seed(settings["seed"])
    module = CausalLMModule(**module_arguments(settings))
    # The stand-in kernel mixes no tokens, unlike the per-document SDPA a one-document row takes: the packing
    # probe would tell them apart. The GPU run's probe passes once at the first batch (warm-up here anyway).
    module.setup_probes.assume_passed(document_attention="varlen_by_document")
    with tempfile.TemporaryDirectory(prefix="host_overhead_") as folder:
        logging = {"logger": CSVLogger(folder), "log_every_n_steps": 1} if log_every_step else {
            "logger": False, "log_every_n_steps": settings["warmup"] + settings["steps"]}  # fmt: skip
        trainer = Trainer(
            accelerator="cpu", devices=1, max_steps=len(batches), precision=settings["precision"],
            gradient_clip_val=1.0, enable_checkpointing=False, enable_model_summary=False, limit_val_batches=0,
            num_sanity_val_steps=0, callbacks=[Clock(), StepProgressBar()], default_root_dir=folder, **logging,
        )  # fmt: skip
        trainer.fit(module, DataLoader(batches, batch_size=None))
    return finish(settings, clock, losses, module.model)


def fit_plain(settings: dict[str, Any], batches: list[dict[str, Any]]) -> dict[str, Any]:
    """The floor: forward, chunked loss, backward, clip, AdamW and schedule on the same model and batches."""
    from lit_memtrain.datamodules.batch import IGNORE_INDEX, shift_targets
    from lit_memtrain.objectives.causal_lm import CausalLMModule
    from lit_memtrain.objectives.optim import optimizer_and_schedule
    from lit_memtrain.techniques.loss import chunked_cross_entropy

    # bf16-true: Lightning builds the model and runs the training step with bf16 as the default dtype.
    default = torch.bfloat16 if settings["precision"] == "bf16-true" else torch.float32
    torch.manual_seed(settings["seed"])
    module = CausalLMModule(**module_arguments(settings))
    with default_dtype(default):
        module.configure_model()  # the same model, built and initialised as the fit builds it
    model = module.model
    built = optimizer_and_schedule(
        model.named_parameters(prefix="model"), learning_rate=2e-5, weight_decay=0.0, betas=(0.9, 0.999),
        warmup=0.0, min_lr_ratio=1.0, optimizer=None, lr_scheduler=None, stepping_batches=lambda: len(batches),
        scaler_clips_gradients=lambda: False,
    )  # fmt: skip
    optimizer, scheduler = built["optimizer"], built["lr_scheduler"]["scheduler"]
    parameters = [p for group in optimizer.param_groups for p in group["params"]]
    decoder, head = model.get_decoder(), model.get_output_embeddings().weight
    clock, losses = StepClock(settings["warmup"] + settings["steps"]), []
    clock.watch(model)
    model.train()
    for index, batch in enumerate(batches):
        clock.batch_start(index)
        with default_dtype(default):
            hidden = decoder(
                input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False,
                cu_seq_lens_q=torch.tensor(batch["cu_seq_lens_on_host"], dtype=torch.int32),
            ).last_hidden_state  # fmt: skip
            targets = shift_targets(batch["labels"]).flatten()
            loss_sum = chunked_cross_entropy(hidden.flatten(0, 1), head.to(hidden.dtype), targets, 1, 1024)
            step_tokens = torch.full((), int((targets != IGNORE_INDEX).sum()), dtype=torch.int64)
            loss = loss_sum * (1 / step_tokens.clamp(min=1))  # as the module scales it
        loss.backward()
        torch.nn.utils.clip_grad_norm_(parameters, 1.0)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        clock.batch_end()
        losses.append(loss.detach().clone())
    clock.end()
    return finish(settings, clock, losses, model)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def finish(settings: dict[str, Any], clock: StepClock, losses: list, model: torch.nn.Module) -> dict[str, Any]:
    warmup, steps = settings["warmup"], settings["steps"]
    return {
        "step_ms": clock.step_ms(warmup, warmup + steps),
        "wall_ms": clock.step_ms(warmup, warmup + steps, wall=True),
        "lead_in_ms": clock.lead_in_ms(warmup, warmup + steps),
        "layers_ms": clock.layers_ms(warmup, warmup + steps),
        "profiled_ms": clock.step_ms(warmup + steps, len(clock.starts) - 1, wall=True),
        "profile": clock.profiler,
        "losses": torch.stack(losses).float(),
        "weights": {name: p.detach().clone() for name, p in model.named_parameters()},
    }


PACKAGES = (("lit_memtrain", "lit_memtrain"), ("lightning", "lightning"), ("transformers", "transformers"),
            ("torch", "torch (Python)"), ("tqdm", "tqdm"))  # fmt: skip


def by_package(profile: cProfile.Profile, steps: int) -> dict[str, float]:
    """cProfile's own time per step (ms) summed by where the function lives; built-ins (torch's operators run
    there: their dispatch and arithmetic) apart."""
    totals: dict[str, float] = {}
    for (filename, _, name), (_, _, tottime, _, _) in pstats.Stats(profile).stats.items():
        if filename == "~":
            where = "built-ins (torch operators, C)"
        else:
            where = next((label for key, label in PACKAGES if f"/{key}/" in filename), "other Python")
        totals[where] = totals.get(where, 0.0) + tottime * 1e3 / steps
    return dict(sorted(totals.items(), key=lambda item: -item[1]))


def top(profile: cProfile.Profile, sort: str, count: int, steps: int, only: str | None = None) -> str:
    """The ``count`` entries first by ``sort`` (``cumulative`` or ``tottime``), per step, with where they live;
    ``only``: those whose file path matches this regular expression."""
    rows = []
    for (filename, line, name), (_, calls, tottime, cumtime, _) in pstats.Stats(profile).stats.items():
        if only is None or re.search(only, filename):
            short = "/".join(Path(filename).parts[-2:]) if filename != "~" else ""
            key = cumtime if sort == "cumulative" else tottime
            rows.append((key, calls, tottime, cumtime, f"{short}:{line}({name})"))
    rows.sort(key=lambda row: -row[0])
    lines = [f"{'calls/step':>10} {'own ms':>8} {'cum ms':>8}  function"]
    for _, calls, tottime, cumtime, where in rows[:count]:
        lines.append(f"{calls / steps:>10.0f} {tottime * 1e3 / steps:>8.2f} {cumtime * 1e3 / steps:>8.2f}  {where}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warmup", type=int, default=2, help="steps before the timed ones (at least 1)")
    parser.add_argument("--steps", type=int, default=6, help="timed steps of each run in each round")
    parser.add_argument("--rounds", type=int, default=4, help="rounds of every run, each in another order")
    parser.add_argument("--profiled", type=int, default=2, help="steps under cProfile after the timed ones")
    parser.add_argument("--top", type=int, default=25, help="profile entries shown")
    parser.add_argument("--precision", default="32-true", choices=["32-true", "bf16-true"],
                        help="bf16-true is the GPU fit's; its host path differs by Lightning's default-dtype context "
                        "only, and bf16 arithmetic is slower on some CPUs")  # fmt: skip
    parser.add_argument("--save", help="write the losses and final weights of ours (as step_profile) here")
    parser.add_argument("--compare", help="check ours (as step_profile) against losses and weights saved by --save")
    parser.add_argument("--no-csv", action="store_true", help="leave out the run that logs every step")
    args = parser.parse_args()
    if args.warmup < 1:
        parser.error("--warmup must be at least 1 (the lead-in is measured from the step before)")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    settings = {
        "preset": "qwen3-0.6b", "max_length": 16384, "median_length": 150, "seed": 0, "vocab_size": TINY["vocab_size"],
        "warmup": args.warmup, "steps": args.steps, "rows": args.warmup + args.steps + args.profiled,
        "precision": args.precision, "dtype": "bfloat16" if args.precision == "bf16-true" else "float32",
    }  # fmt: skip
    install_varlen_stand_in()
    from lightning.pytorch.utilities import disable_possible_user_warnings

    disable_possible_user_warnings()
    batches = packed_batches(settings)
    documents = statistics.mean(len(b["cu_seq_lens_on_host"]) - 1 for b in batches)
    short, short_batches = settings | {"max_length": SHORT_ROWS}, [first_tokens(b, SHORT_ROWS) for b in batches]
    fits: dict[str, Callable[[], dict[str, Any]]] = {
        "plain loop": lambda: fit_plain(settings, batches),
        "ours (as step_profile)": lambda: fit_ours(settings, batches, log_every_step=False),
        "ours, CSVLogger every step": lambda: fit_ours(settings, batches, log_every_step=True),
        f"plain loop, {SHORT_ROWS}-token rows": lambda: fit_plain(short, short_batches),
        f"ours, {SHORT_ROWS}-token rows": lambda: fit_ours(short, short_batches, log_every_step=False),
    }
    if args.no_csv:
        del fits["ours, CSVLogger every step"]
    runs: dict[str, dict[str, Any]] = {}
    names = list(fits)
    for round_ in range(args.rounds):  # each round in another order: the machine's load drifts
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            run = fits[name]()
            if name in runs:  # the step times of every round; the profile, losses and weights of the last
                run.update({key: runs[name][key] + run[key] for key in TIMES})
            runs[name] = run
    report(args, settings, documents, {name: runs[name] for name in names})


TIMES = ("step_ms", "wall_ms", "lead_in_ms", "layers_ms")


SHORT_ROWS = 512


def first_tokens(batch: dict[str, Any], length: int) -> dict[str, Any]:
    """The first ``length`` tokens of a packed row, collated again: the same model's operators on little data."""
    from lit_memtrain.datamodules.padding_free import PaddingFreeCollator

    ids = batch["input_ids"][0, :length].tolist()
    bounds = [b for b in batch["cu_seq_lens_on_host"] if b < length] + [length]
    return PaddingFreeCollator()([{"input_ids": ids[a:b]} for a, b in itertools.pairwise(bounds)])


def report(args: argparse.Namespace, settings: dict[str, Any], documents: float, runs: dict[str, Any]) -> None:
    print(f"\nQwen3, 28 layers of {TINY}, {settings['precision']}, rows of {settings['max_length']:,} tokens "
          f"({documents:.0f} documents a row on average); medians of {args.rounds} rounds of {args.steps} steps after "
          f"{args.warmup}; "
          f"torch threads {torch.get_num_threads()}")  # fmt: skip
    print(f"{'run':<36} {'CPU ms/step':>11} {'min':>7} {'max':>7} {'- plain':>8} {'lead-in':>8} {'- plain':>8} "
          f"{'layers':>7} {'wall ms':>8} {'- plain':>8}")  # fmt: skip
    for name, run in runs.items():
        plain = runs["plain loop" if "token rows" not in name else f"plain loop, {SHORT_ROWS}-token rows"]
        floor, lead_floor = statistics.median(plain["step_ms"]), statistics.median(plain["lead_in_ms"])
        median, lead = statistics.median(run["step_ms"]), statistics.median(run["lead_in_ms"])
        wall, layers = statistics.median(run["wall_ms"]), statistics.median(run["layers_ms"])
        wall_floor = statistics.median(plain["wall_ms"])
        print(f"{name:<36} {median:>11.1f} {min(run['step_ms']):>7.1f} {max(run['step_ms']):>7.1f} "
              f"{median - floor:>8.1f} {lead:>8.1f} {lead - lead_floor:>8.1f} {layers:>7.1f} {wall:>8.1f} "
              f"{wall - wall_floor:>8.1f}")  # fmt: skip
    print("CPU: this process's CPU time (the machine may be shared); - plain: against the plain loop on the same rows; "
          "lead-in: CPU time from the end of the step before (the loss computed, the weights updated; the progress bar "
          "then reads the loss) to the first decoder layer; layers: the forward through the 28 decoder layers")
    for name, run in runs.items():
        if name.startswith("ours"):
            plain = runs["plain loop" if "token rows" not in name else f"plain loop, {SHORT_ROWS}-token rows"]
            same = torch.equal(run["losses"], plain["losses"])
            print(f"{name}: losses {'bit-identical to' if same else 'DIFFER from'} the plain loop's")

    tables = {name: by_package(run["profile"], len(run["profiled_ms"])) for name, run in runs.items()}
    places = sorted({where for table in tables.values() for where in table}, key=lambda w: -tables["plain loop"].get(
        w, 0) - tables["ours (as step_profile)"].get(w, 0))  # fmt: skip
    names = [name for name in runs if "token rows" not in name]
    print(f"\ncProfile, {args.profiled} steps of each: own time per step by where the function lives, ms "
          "(Python operators on tensors count as their caller's)")  # fmt: skip
    print(f"{'':<34}" + "".join(f"{name[:26]:>28}" for name in names))
    for where in places:
        print(f"{where:<34}" + "".join(f"{tables[name].get(where, 0.0):>28.1f}" for name in names))
    print(f"{'all (profiled wall time)':<34}" + "".join(
        f"{statistics.mean(runs[name]['profiled_ms']):>28.1f}" for name in names))  # fmt: skip

    ours, steps = runs["ours (as step_profile)"]["profile"], args.profiled
    stack = "/(lightning|lit_memtrain|tqdm|lightning_utilities|torchmetrics)/"
    print(f"\n-- ours: top {args.top} by cumulative time --\n{top(ours, 'cumulative', args.top, steps)}")
    print(f"\n-- ours: top {args.top} by own time --\n{top(ours, 'tottime', args.top, steps)}")
    print(f"\n-- ours: top {args.top} by own time in {stack} --\n{top(ours, 'tottime', args.top, steps, stack)}")
    saved = runs["ours (as step_profile)"]
    if args.save:
        torch.save({"losses": saved["losses"], "weights": saved["weights"]}, args.save)
        print(f"\nsaved the losses and weights of ours to {args.save}")
    if args.compare:
        before = torch.load(args.compare)
        same_losses = torch.equal(before["losses"], saved["losses"])
        same_weights = before["weights"].keys() == saved["weights"].keys() and all(
            torch.equal(before["weights"][k], v) for k, v in saved["weights"].items())  # fmt: skip
        print(f"\nagainst {args.compare}: losses {'bit-identical' if same_losses else 'DIFFER'}, "
              f"weights {'bit-identical' if same_weights else 'DIFFER'}")  # fmt: skip
        if not (same_losses and same_weights):
            sys.exit(1)


if __name__ == "__main__":
    main()
