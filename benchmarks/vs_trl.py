"""Benchmark: ``lit-memtrain fit`` against TRL's ``SFTTrainer``, trained tokens per second, side by side.

Same for both:

- weights: one random ``tiny-qwen3`` (the shape of ``benchmarks/throughput.py``: hidden 512, 2 layers,
  fp32) built once, saved with ``save_pretrained`` and loaded by each run. Attention: TRL's default for a
  padding-free row, sdpa (which masks a dense row); ours its default when none is named, the fastest
  implementation that keeps packed documents apart on the device (``sdpa_by_document`` on a CPU: SDPA once
  per packed document, see ``lit_memtrain/techniques/attention.py``). ``--attention sdpa`` gives ours the same kernel as
  TRL;
- tokenizer: the embedded one, saved next to the weights.
  With ``--model smollm2-135m-instruct`` (``benchmarks/real_model.py``) weights and tokenizer are instead those of the
  real pretrained model, loaded once from its packaged GGUF file (float32) and saved the same way;
- data: the synthetic ``text`` examples of ``benchmarks/throughput.py`` (lognormal lengths, median 100,
  clipped to [8, ``--max-length``]) in one JSON-lines file, every token trained;
- packing: ``bfd`` into rows of ``--max-length`` tokens, collated padding-free (``position_ids`` restarting
  per document), ``--batch-size`` rows per step, no gradient accumulation;
- optimisation: AdamW (betas 0.9/0.999, no weight decay), constant learning rate, no warm-up, gradient
  clipping at 1.0, no gradient checkpointing (TRL's default is on: turned off), fp32 on CPU;
- loss: mean cross-entropy over the step's trainable targets (TRL divides by ``num_items_in_batch``, the
  shifted label count, which is the same normalisation); both compute it from hidden states without full
  logits (ours: chunked loss; TRL: fused LM head, which also computes entropy and top-1 accuracy);
- timing: seconds from the start to the end of each training step (ours: a Lightning callback from
  ``on_train_batch_start`` to ``on_train_batch_end``; TRL: a ``TrainerCallback`` from ``on_step_begin`` to
  ``on_step_end``), both spanning forward, loss, backward, clipping and the optimizer step and neither the
  data loading before it nor the logging after it, after ``--warmup-steps`` untimed steps. Tokens are the
  real tokens of each timed step, counted from the batch each framework trained on. On one thread the
  headline uses each step's process CPU time (``time.process_time``), which does not count time another
  process held the core; the wall-clock figure is printed beside it.

TRL packs each ``datasets.map`` batch of 1000 examples on its own and we pack globally, and the two shuffle
rows differently, so the rows differ slightly; the script prints the tokens per step of both and fails if
their means differ by more than 2% (it also fails unless both tokenized the data to the same total).

Optimizer kernel: both use torch's fused AdamW (TRL's default ``adamw_torch_fused``; ours whenever the
parameters allow it); ``--trl-optim adamw_torch`` gives TRL the per-tensor loop instead.

Each framework runs in its own subprocess (ours through ``python -m lit_memtrain.cli fit``; its peak resident set
size is reported), alternating in ``--rounds`` rounds on the shared machine; torch runs on ``--threads`` threads in
both (one by default, see ``benchmarks/throughput.py``). Headline: median over rounds of ours/TRL tokens per
second. Target: ours >= 1.25x with the defaults on the tiny model, whose attention is a large share of a step
(>= 1.0x with ``--attention sdpa``, and on a real model).

Run from the repository root (needs trl: ``pip install -e .[bench]``; about 2 minutes on 2 CPU cores)::

    python benchmarks/vs_trl.py
    python benchmarks/vs_trl.py --rounds 1 --steps 4   # a quick look
    python benchmarks/vs_trl.py --model smollm2-135m-instruct --max-length 512 --examples 400 --steps 4 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import NoReturn

from real_model import MIB, TINY, add_model_option, run_measured, save_real_model

BENCHMARKS = Path(__file__).resolve().parent


def worker_trl(args: argparse.Namespace) -> None:
    """Train with TRL's SFTTrainer and write the step records to ``args.output``."""
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    datasets.disable_progress_bars()
    records = {"step_seconds": [], "step_cpu_seconds": [], "tokens": [], "trainable_targets": [], "losses": []}

    class StepTimerCallback(TrainerCallback):
        def on_step_begin(self, train_args, state, control, **kwargs):
            self.started_at = time.perf_counter()
            self.cpu_started_at = time.process_time()

        def on_step_end(self, train_args, state, control, **kwargs):
            records["step_seconds"].append(time.perf_counter() - self.started_at)
            records["step_cpu_seconds"].append(time.process_time() - self.cpu_started_at)

    class CountingSFTTrainer(SFTTrainer):
        """Records the real tokens, trainable targets and loss of each step (one micro-batch per step)."""

        def training_step(self, model, inputs, num_items_in_batch=None):
            loss = super().training_step(model, inputs, num_items_in_batch)
            records["tokens"].append(int(inputs["position_ids"].numel()))
            records["trainable_targets"].append(int((inputs["labels"][..., 1:] != -100).sum()))
            records["losses"].append(float(loss))
            return loss

    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32, attn_implementation="sdpa")
    dataset = datasets.load_dataset("json", data_files=args.data, split="train")
    config = SFTConfig(
        output_dir=str(Path(args.output).parent / "trl_output"),
        packing=True,
        packing_strategy="bfd",
        padding_free=True,
        max_length=args.max_length,
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=1,
        max_steps=args.warmup_steps + args.steps,
        learning_rate=args.learning_rate,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        optim=args.trl_optim,
        max_grad_norm=1.0,
        activation_checkpointing=False,
        bf16=False,
        fp16=False,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=args.seed,
    )
    trainer = CountingSFTTrainer(
        model=model,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[StepTimerCallback()],
    )
    if trainer.model.is_activation_checkpointing:
        fail("TRL enabled activation checkpointing; this comparison runs without it.")
    dataset_tokens = sum(sum(lengths) for lengths in trainer.train_dataset["seq_lengths"])
    trainer.train()
    skip = args.warmup_steps
    result = {key: values[skip:] for key, values in records.items()}
    result["dataset_tokens"] = int(dataset_tokens)
    Path(args.output).write_text(json.dumps(result))


def run_ours(args: argparse.Namespace, model_dir: Path, data: Path, output: Path, log: Path) -> dict:
    command = [
        sys.executable, "-m", "lit_memtrain.cli", "fit",
        "--seed_everything=0",
        "--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.precision=32-true",
        f"--trainer.max_steps={args.warmup_steps + args.steps}",
        "--trainer.gradient_clip_val=1.0",
        "--trainer.logger=false", "--trainer.enable_checkpointing=false",
        "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
        "--trainer.limit_val_batches=0", "--trainer.num_sanity_val_steps=0",
        "--trainer.callbacks+=throughput.StepTimer",
        f"--trainer.callbacks.warmup_steps={args.warmup_steps}",
        f"--trainer.callbacks.output={output}",
        f"--model.model={model_dir}", "--model.dtype=float32",
        *([] if args.attention == "default" else [f"--model.attn_implementation={args.attention}"]),
        f"--model.learning_rate={args.learning_rate}", "--model.weight_decay=0.0",
        "--model.warmup=0", "--model.min_lr_ratio=1.0", "--model.loss_type=chunked",
        f"--data.tokenizer={model_dir}", f"--data.dataset={data}",
        f"--data.max_length={args.max_length}", "--data.packing=true", "--data.packing_strategy=bfd",
        f"--data.batch_size={args.batch_size}", f"--data.seed={args.seed}",
    ]  # fmt: skip
    return run_subprocess(command, output, log, args.threads)


def run_trl(args: argparse.Namespace, model_dir: Path, data: Path, output: Path, log: Path) -> dict:
    command = [
        sys.executable, str(Path(__file__).resolve()), "--worker", "trl",
        "--model-dir", str(model_dir), "--data", str(data), "--output", str(output),
        "--max-length", str(args.max_length), "--batch-size", str(args.batch_size),
        "--steps", str(args.steps), "--warmup-steps", str(args.warmup_steps),
        "--learning-rate", str(args.learning_rate), "--trl-optim", args.trl_optim, "--seed", str(args.seed),
    ]  # fmt: skip
    return run_subprocess(command, output, log, args.threads)


def run_subprocess(command: list[str], output: Path, log: Path, threads: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(BENCHMARKS), env.get("PYTHONPATH")]))
    returncode, peak_rss = run_measured(command, env, log)
    if returncode != 0 or not output.exists():
        tail = "\n".join(log.read_text().splitlines()[-30:])
        fail(f"{' '.join(command[:5])} ... exited with {returncode}; last lines of {log}:\n{tail}")
    return {**json.loads(output.read_text()), "peak_rss": peak_rss}


def fail(message: str) -> NoReturn:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(1)


def prepare(args: argparse.Namespace, workdir: Path) -> tuple[Path, Path, int]:
    """Save one random model (or ``--model``'s real one) and the tokenizer to a directory, and the data to a
    JSON-lines file."""
    import datasets
    import torch
    import transformers
    from throughput import MODEL_OVERRIDES, lognormal_lengths, text_dataset
    from transformers import AutoModelForCausalLM

    from lit_memtrain.datamodules.embedded import EMBEDDED
    from lit_memtrain.models.presets import build_config
    from lit_memtrain.datamodules.tokenizer import load_tokenizer

    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()
    model_dir = workdir / "model"
    if args.model != TINY:
        tokenizer = load_tokenizer(str(save_real_model(args.model, model_dir)))
    else:
        tokenizer = load_tokenizer(EMBEDDED)
        overrides = {
            **MODEL_OVERRIDES,
            "vocab_size": len(tokenizer),
            "pad_token_id": tokenizer.pad_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "bos_token_id": tokenizer.bos_token_id,
        }
        torch.manual_seed(args.seed)
        model = AutoModelForCausalLM.from_config(build_config("tiny-qwen3", overrides), dtype=torch.float32)
        model.save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
    lengths = lognormal_lengths(args.examples, 100, 1.0, 8, args.max_length, args.seed)
    data = workdir / "data.jsonl"
    text_dataset(lengths, tokenizer, args.seed).to_json(str(data))
    return model_dir, data, int(lengths.sum())


def tokens_per_second(run: dict, clock: str) -> float:
    """Real tokens per second of timed step time, by the ``wall`` clock or the process's ``cpu`` time."""
    return sum(run["tokens"]) / sum(run["step_seconds" if clock == "wall" else "step_cpu_seconds"])


def clock_for(args: argparse.Namespace) -> str:
    """CPU time on one thread (not counting time other processes held the core), else the wall clock."""
    return "cpu" if args.threads == 1 else "wall"


def summarise(args: argparse.Namespace, ours: list[dict], trl_runs: list[dict], dataset_tokens: int) -> None:
    from throughput import print_table

    clock = clock_for(args)
    frameworks = {"lit-memtrain": ours, "trl": trl_runs}
    for name, runs in frameworks.items():
        steps = {len(run["step_seconds"]) for run in runs} | {len(run["tokens"]) for run in runs}
        if steps != {args.steps}:
            fail(f"{name} recorded {sorted(steps)} timed steps per run, expected {args.steps}.")
    if trl_runs[0]["dataset_tokens"] != dataset_tokens:
        fail(
            f"TRL tokenized the data to {trl_runs[0]['dataset_tokens']} tokens, the designed total is "
            f"{dataset_tokens}: the two frameworks do not train on the same tokens."
        )

    def mean_per_step(runs: list[dict], key: str) -> float:
        return statistics.mean(value for run in runs for value in run[key])

    ours_tokens, trl_tokens = mean_per_step(ours, "tokens"), mean_per_step(trl_runs, "tokens")
    if abs(ours_tokens / trl_tokens - 1) > 0.02:
        fail(f"tokens per step differ by more than 2% (ours {ours_tokens:.0f}, TRL {trl_tokens:.0f}).")

    rows = [("", "tokens/step", "targets/step", f"tokens/s ({clock})", "tokens/s (wall)", "loss, last", "loss, last 5",
             "peak RSS MiB")]
    for name, runs in frameworks.items():
        rows.append(
            (
                name,
                f"{mean_per_step(runs, 'tokens'):,.1f}",
                f"{mean_per_step(runs, 'trainable_targets'):,.1f}",
                f"{statistics.median(tokens_per_second(run, clock) for run in runs):,.0f}",
                f"{statistics.median(tokens_per_second(run, 'wall') for run in runs):,.0f}",
                f"{statistics.mean(run['losses'][-1] for run in runs):.4f}",
                f"{statistics.mean(statistics.mean(run['losses'][-5:]) for run in runs):.4f}",
                f"{statistics.median(run['peak_rss'] for run in runs) / MIB:,.0f}",
            )
        )
    print_table(rows)

    def ratios(by: str) -> list[float]:
        return [tokens_per_second(a, by) / tokens_per_second(b, by) for a, b in zip(ours, trl_runs)]

    ratio = statistics.median(ratios(clock))
    target = 1.0 if args.attention == "sdpa" or args.model != TINY else 1.25
    print(
        f"ours / TRL tokens per second ({clock} time): {ratio:.2f}x (median of rounds: "
        f"{', '.join(f'{r:.2f}' for r in ratios(clock))}); target >= {target:.2f}x {'met' if ratio >= target else 'NOT met'}; "
        f"by the wall clock {statistics.median(ratios('wall')):.2f}x"
    )
    print(
        "both losses are the mean over the step's trainable targets; rows and their order differ, so losses "
        "agree only approximately; peak RSS: median over rounds of each process's peak resident set size"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=2000)
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=1, help="packed rows per step")
    parser.add_argument("--steps", type=int, default=12, help="timed steps per run")
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument(
        "--attention",
        default="default",
        choices=["default", "sdpa", "sdpa_by_document"],
        help="ours (default: none named, the module's own choice); TRL always uses sdpa",
    )
    parser.add_argument("--trl-optim", default="adamw_torch_fused", help="TRL's optim (its default: fused AdamW)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    add_model_option(parser)
    parser.add_argument("--worker", choices=["trl"], help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--output", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker == "trl":
        worker_trl(args)
        return
    if min(args.steps, args.rounds, args.batch_size, args.threads) < 1 or args.warmup_steps < 0:
        fail("--steps, --rounds, --batch-size and --threads must be >= 1 and --warmup-steps >= 0.")
    if args.max_length < 8:
        fail(f"--max-length must be at least 8 (the shortest synthetic example), got {args.max_length}.")
    if args.steps < 5:
        print("note: fewer than 5 timed steps; 'loss, last 5' averages what there is")
    try:
        import trl
    except ImportError:
        fail("trl is not installed: pip install -e '.[bench]'")

    with tempfile.TemporaryDirectory(prefix="vs_trl_") as directory:
        workdir = Path(directory)
        start = time.perf_counter()
        model_dir, data, dataset_tokens = prepare(args, workdir)
        print(
            f"trl {trl.__version__}; {args.examples} examples, {dataset_tokens:,} tokens; rows of {args.max_length}, "
            f"{args.batch_size} per step; {args.warmup_steps} warm-up + {args.steps} timed steps per run; "
            f"{args.threads} thread(s); model {args.model}; attention: ours {args.attention}, TRL sdpa; "
            f"prepared in {time.perf_counter() - start:.1f} s"
        )
        ours, trl_runs = [], []
        for round_index in range(args.rounds):
            runners = [("ours", run_ours, ours), ("trl", run_trl, trl_runs)]
            for name, runner, results in runners if round_index % 2 == 0 else runners[::-1]:
                output = workdir / f"{name}-{round_index}.json"
                results.append(runner(args, model_dir, data, output, workdir / f"{name}-{round_index}.log"))
            clock = clock_for(args)
            print(
                f"round {round_index + 1}: ours {tokens_per_second(ours[-1], clock):,.0f} tok/s, "
                f"trl {tokens_per_second(trl_runs[-1], clock):,.0f} tok/s ({clock} time)"
            )
        summarise(args, ours, trl_runs, dataset_tokens)


if __name__ == "__main__":
    main()
