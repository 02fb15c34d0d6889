"""Benchmark: training tokens per second, padded batches against packed padding-free batches, side by side.

Data: ``text`` examples whose token lengths are drawn from a lognormal (median 100, sigma 1, clipped to
[8, 1024]; mean about 155), the shape of real SFT data: most examples short, a long tail. Each text is
made of words that are single tokens of the embedded tokenizer, so an example of length ``n`` tokenizes
to exactly ``n - 1`` tokens plus eos; the script checks every length after tokenization.

Model: ``tiny-qwen3`` with hidden size 512 (8 heads of 64, MLP 1536) and 2 layers, fp32 on CPU, sdpa
attention, the same random initialisation for both runs, AdamW, gradient clipping at 1.0, a real
Lightning ``Trainer`` and :class:`~lit_memtrain.objectives.causal_lm.CausalLMModule`. Why that width: per token and
layer, attention over a 1024-token row costs about ``2 * 1024 * heads * head_dim`` multiply-adds and the
linear layers about ``d * (q + k + v + o widths) + 3 * d * mlp``. At this shape attention is about 0.35 of
the linear cost, close to Qwen3-0.6B (0.27); at the quickstart's width (128) it is 1.3x the linear cost,
and on CPU sdpa a packed row's block-diagonal mask is dense (it skips no work, unlike flash-attn varlen on
a GPU), so a narrow model would mostly measure that artefact (1.2-1.4x at widths 128-256 in our runs).

With ``--attention sdpa_by_document`` both runs use it: padded batches still go through sdpa (they carry a
padding mask), packed rows run SDPA once per document and skip the cross-document blocks.

The two configurations:

- ``padded``: ``SFTDataModule(batch_size=8)``, each batch padded to its longest example. This is what a user
  gets by default (8 is the datamodule's default batch size); no length grouping.
- ``packed``: ``SFTDataModule(packing=True, batch_size=1)``: one row of at most 1024 tokens per step, about
  6.6 examples (BFD-packed), collated padding-free. One row, not several: with sdpa, a padding-free
  batch is one flat sequence whose attention mask is built densely over all of it, so several rows per
  step would pay quadratic attention over the whole batch (flash-attn varlen does not; CPU has none).

The comparison is fair on work, not on step count: each run trains for as many steps as it takes to reach
the same budget of real (non-padding) tokens (``--token-budget``, counted after the warm-up steps by
replaying the seeded data loader), since the two configurations carry different numbers of real tokens
per step (both printed). The printed upper bound ``1 / (1 - pad share)`` is what removing the padding
alone would give if every position cost the same. The default budget (18,000 tokens, 17 padded steps)
gives timed batches whose pad share (63.6%) is close to that of a whole epoch (65.5%, also printed); a
budget of 10,000 happens to time the least padded batches (56%).

Tokens per second = real tokens / seconds of step time, measured by a callback from
``on_train_batch_start`` to ``on_train_batch_end`` (forward, loss, backward, clipping, optimizer step),
after ``--warmup-steps`` untimed steps; data preparation (tokenizing, packing) is done once, before any
timing. Target: packed >= 2x padded.

Noise: the machine is shared with other jobs. Torch runs on one thread by default (``--threads``): two
OpenMP threads wait on each other whenever another process holds a core, which made steps 2-3x slower
and erratic in our measurements. With one thread the headline figure uses the process's CPU time of each
step (``time.process_time``), which does not count the time another process held the core; the wall-clock
figure is printed beside it (with several threads it is the headline). The two configurations alternate
in ``--rounds`` rounds (padded then packed, then packed then padded, ...) and the headline is the median
of the per-round ratios.

Run from the repository root (about 3 minutes on 2 CPU cores)::

    python benchmarks/throughput.py
    python benchmarks/throughput.py --rounds 1 --token-budget 4000   # a quick look
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any, NoReturn

import datasets
import numpy as np
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.utils.data import DataLoader

from lit_memtrain.datamodules.embedded import EMBEDDED
from lit_memtrain.datamodules.sft import SFTDataModule
from lit_memtrain.objectives.causal_lm import CausalLMModule
from lit_memtrain.datamodules.tokenizer import load_tokenizer

MODEL_OVERRIDES = {
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
}
"""A tiny Qwen3 (2 layers, 6.2M parameters) with a real model's proportions of attention to linear-layer
cost per token (see the module docstring)."""


class StepTimer(Callback):
    """Time each training step from ``on_train_batch_start`` to ``on_train_batch_end`` and count its tokens.

    The first ``warmup_steps`` steps are not recorded. With ``output``, the records are written there as
    JSON when training ends (for a run in another process, such as ``lit-memtrain fit``).

    Example::

        timer = StepTimer(warmup_steps=2)
        Trainer(callbacks=[timer], max_steps=20).fit(module, datamodule=dm)
        print(timer.tokens_per_second())
    """

    def __init__(self, warmup_steps: int = 2, output: str | None = None) -> None:
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}.")
        self.warmup_steps = warmup_steps
        self.output = output
        self.step_seconds: list[float] = []
        self.step_cpu_seconds: list[float] = []
        self.tokens: list[int] = []
        self.positions: list[int] = []
        self.trainable_targets: list[int] = []
        self.losses: list[float] = []
        self._started_at = 0.0
        self._cpu_started_at = 0.0
        self._steps_seen = 0

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._started_at = time.perf_counter()
        self._cpu_started_at = time.process_time()

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        elapsed = time.perf_counter() - self._started_at
        cpu_elapsed = time.process_time() - self._cpu_started_at
        self._steps_seen += 1
        if self._steps_seen <= self.warmup_steps:
            return
        self.step_seconds.append(elapsed)
        self.step_cpu_seconds.append(cpu_elapsed)
        self.tokens.append(CausalLMModule.count_tokens(batch))
        self.positions.append(batch["input_ids"].numel())
        self.trainable_targets.append(int((batch["labels"][..., 1:] != -100).sum()))
        self.losses.append(float(trainer.callback_metrics["train/loss"]))  # the micro-batch mean

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.output:
            Path(self.output).write_text(json.dumps(self.records()))

    def records(self) -> dict[str, list]:
        """The timed steps' wall and CPU seconds, real tokens, positions (with padding), trainable targets and
        losses."""
        return {
            "step_seconds": self.step_seconds,
            "step_cpu_seconds": self.step_cpu_seconds,
            "tokens": self.tokens,
            "positions": self.positions,
            "trainable_targets": self.trainable_targets,
            "losses": self.losses,
        }

    def tokens_per_second(self, clock: str = "wall") -> float:
        """Real tokens per second of timed step time, by the ``wall`` clock or the process's ``cpu`` time."""
        return sum(self.tokens) / sum(self.step_seconds if clock == "wall" else self.step_cpu_seconds)


def fail(message: str) -> NoReturn:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(1)


def lognormal_lengths(num_examples: int, median: float, sigma: float, low: int, high: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(np.rint(rng.lognormal(np.log(median), sigma, num_examples)), low, high).astype(np.int64)


def single_token_words(tokenizer: Any) -> list[str]:
    """Words that the tokenizer encodes, with a leading space, as exactly one token (and that aren't special)."""
    words = []
    for piece in tokenizer.get_vocab():
        word = tokenizer.convert_tokens_to_string([piece]).strip()
        if word.isalpha() and len(tokenizer(" " + word, add_special_tokens=False)["input_ids"]) == 1:
            words.append(word)
    return sorted(set(words))


def text_dataset(lengths: np.ndarray, tokenizer: Any, seed: int) -> datasets.Dataset:
    """One ``text`` example per length ``n``: ``n - 1`` single-token words (eos, appended by the
    datamodule, is the ``n``-th token)."""
    words = single_token_words(tokenizer)
    if len(words) < 2:
        fail(f"the tokenizer has {len(words)} single-token words; the synthetic data needs at least 2.")
    rng = np.random.default_rng(seed)
    vocabulary = np.array([" " + word for word in words])
    texts = ["".join(rng.choice(vocabulary, int(n) - 1)) for n in lengths]
    return datasets.Dataset.from_dict({"text": texts})


def check_token_lengths(dm: SFTDataModule, expected: np.ndarray) -> None:
    """Exit with a message unless the tokenized dataset has exactly the designed lengths (nothing truncated,
    nothing dropped, every word one token)."""
    dm.setup("fit")
    column = "seq_lengths" if dm.packing else "input_ids"
    found = dm.train_dataset[column]
    lengths = np.concatenate([np.asarray(x) for x in found]) if dm.packing else np.array([len(x) for x in found])
    if not np.array_equal(np.sort(lengths), np.sort(expected)):
        fail(
            f"the tokenized data does not have the designed lengths ({len(lengths)} documents, "
            f"{int(lengths.sum())} tokens; expected {len(expected)} and {int(expected.sum())}). Check that "
            "max_length >= the longest example and that the tokenizer is the embedded one."
        )


def steps_for_token_budget(loader: DataLoader, warmup_steps: int, budget: int) -> int:
    """Steps (warm-up included) after which the measured steps hold at least ``budget`` real tokens."""
    tokens, step = 0, 0
    for step, batch in enumerate(loader, start=1):
        if step > warmup_steps:
            tokens += CausalLMModule.count_tokens(batch)
            if tokens >= budget:
                return step
    fail(f"one epoch of {step} batches holds fewer than {budget} real tokens after warm-up: use more --examples.")


def pad_share(loader: DataLoader) -> float:
    """Share of padding positions over a whole epoch of ``loader``."""
    tokens = positions = 0
    for batch in loader:
        tokens += CausalLMModule.count_tokens(batch)
        positions += batch["input_ids"].numel()
    return 1 - tokens / positions


def train(dm: SFTDataModule, steps: int, warmup_steps: int, learning_rate: float, attention: str) -> StepTimer:
    torch.manual_seed(0)
    module = CausalLMModule(
        preset="tiny-qwen3",
        config_overrides=MODEL_OVERRIDES,
        tokenizer=EMBEDDED,
        attn_implementation=attention,
        learning_rate=learning_rate,
        warmup=0,
        min_lr_ratio=1.0,
    )
    module.configure_model()
    timer = StepTimer(warmup_steps)
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        precision="32-true",
        max_steps=steps,
        gradient_clip_val=1.0,
        callbacks=[timer],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    trainer.fit(module, datamodule=dm)
    return timer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=2000)
    parser.add_argument("--median-length", type=float, default=100)
    parser.add_argument("--sigma", type=float, default=1.0)
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--padded-batch-size", type=int, default=8)
    parser.add_argument("--packed-rows", type=int, default=1)
    parser.add_argument("--token-budget", type=int, default=18_000, help="real tokens per run, after warm-up")
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (see the docstring)")
    parser.add_argument("--attention", default="sdpa", choices=["sdpa", "sdpa_by_document"], help="for both runs")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.rounds < 1 or args.token_budget < 1 or args.warmup_steps < 0 or args.threads < 1:
        fail("--rounds, --token-budget and --threads must be >= 1 and --warmup-steps >= 0.")
    if args.max_length < 8:
        fail(f"--max-length must be at least 8 (the shortest synthetic example), got {args.max_length}.")
    torch.set_num_threads(args.threads)
    datasets.disable_progress_bars()
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*LeafSpec.*")

    start = time.perf_counter()
    tokenizer = load_tokenizer(EMBEDDED)
    lengths = lognormal_lengths(args.examples, args.median_length, args.sigma, 8, args.max_length, args.seed)
    dataset = text_dataset(lengths, tokenizer, args.seed)
    common = {"dataset": dataset, "max_length": args.max_length, "seed": args.seed}
    configs = {
        "padded": SFTDataModule(batch_size=args.padded_batch_size, **common),
        "packed": SFTDataModule(batch_size=args.packed_rows, packing=True, **common),
    }
    steps = {}
    for name, dm in configs.items():
        check_token_lengths(dm, lengths)
        steps[name] = steps_for_token_budget(dm.train_dataloader(), args.warmup_steps, args.token_budget)
    packed_rows = configs["packed"].train_dataset
    fill = lengths.sum() / (len(packed_rows) * args.max_length)
    print(
        f"{args.examples} examples, {int(lengths.sum()):,} tokens, lengths median {np.median(lengths):.0f} "
        f"mean {lengths.mean():.0f} max {lengths.max()}; packed into {len(packed_rows)} rows of "
        f"{args.max_length} (fill {100 * fill:.1f}%); data prepared in {time.perf_counter() - start:.1f} s"
    )
    print(
        f"steps per run (after {args.warmup_steps} warm-up steps): padded {steps['padded'] - args.warmup_steps} "
        f"x {args.padded_batch_size} examples, packed {steps['packed'] - args.warmup_steps} x "
        f"{args.packed_rows} row(s); attention {args.attention}; torch threads {torch.get_num_threads()}; "
        "padded batches' pad share over "
        f"a whole epoch {100 * pad_share(configs['padded'].train_dataloader()):.1f}%"
    )

    clock = "cpu" if args.threads == 1 else "wall"
    timers: dict[str, list[StepTimer]] = {name: [] for name in configs}
    order = list(configs)
    for round_index in range(args.rounds):
        for name in order if round_index % 2 == 0 else order[::-1]:
            timers[name].append(
                train(configs[name], steps[name], args.warmup_steps, args.learning_rate, args.attention)
            )
        padded, packed = timers["padded"][-1], timers["packed"][-1]
        print(
            f"round {round_index + 1}: padded {padded.tokens_per_second(clock):,.0f} tok/s, "
            f"packed {packed.tokens_per_second(clock):,.0f} tok/s ({clock} time), "
            f"ratio {packed.tokens_per_second(clock) / padded.tokens_per_second(clock):.2f}x; by the wall clock "
            f"{packed.tokens_per_second('wall') / padded.tokens_per_second('wall'):.2f}x"
        )
    report(timers, clock)


def print_table(rows: list[tuple[str, ...]]) -> None:
    """Print rows of cells right-aligned in columns (the first row is the header)."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.rjust(width) for cell, width in zip(row, widths)))


def report(timers: dict[str, list[StepTimer]], clock: str) -> None:
    """Print per-configuration medians and the packed/padded ratio (median over rounds) by ``clock`` and wall."""
    rows = [("config", "real tokens/step", "pad share", "step s (median)", f"tokens/s ({clock})", "tokens/s (wall)")]
    for name, runs in timers.items():
        tokens = sum(sum(t.tokens) for t in runs)
        positions = sum(sum(t.positions) for t in runs)
        steps_run = sum(len(t.tokens) for t in runs)
        step_seconds = [s for t in runs for s in (t.step_cpu_seconds if clock == "cpu" else t.step_seconds)]
        rows.append(
            (
                name,
                f"{tokens / steps_run:,.0f}",
                f"{100 * (1 - tokens / positions):.1f}%",
                f"{statistics.median(step_seconds):.3f}",
                f"{statistics.median(t.tokens_per_second(clock) for t in runs):,.0f}",
                f"{statistics.median(t.tokens_per_second('wall') for t in runs):,.0f}",
            )
        )
    print_table(rows)

    def ratios(by: str) -> list[float]:
        return [b.tokens_per_second(by) / a.tokens_per_second(by) for a, b in zip(timers["padded"], timers["packed"])]

    ratio = statistics.median(ratios(clock))
    padded_runs = timers["padded"]
    pad_share = 1 - sum(sum(t.tokens) for t in padded_runs) / sum(sum(t.positions) for t in padded_runs)
    print(
        f"packed / padded tokens per second ({clock} time): {ratio:.2f}x (median of rounds: "
        f"{', '.join(f'{r:.2f}' for r in ratios(clock))}); target >= 2x {'met' if ratio >= 2 else 'NOT met'}"
    )
    print(
        f"by the wall clock: {statistics.median(ratios('wall')):.2f}x; upper bound from the pad share alone: "
        f"{1 / (1 - pad_share):.2f}x"
    )


if __name__ == "__main__":
    main()
