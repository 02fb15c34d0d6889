"""Benchmark: GRPO with ``GRPOModule`` against TRL's ``GRPOTrainer`` (steps/s, generated tokens/s), side by side,
and the simulated peak memory of a Qwen3-4B GRPO step with and without the memory techniques.

Throughput, the same for both:

- weights: one random ``tiny-qwen3`` (hidden ``--hidden``, ``--layers`` layers, fp32) saved with
  ``save_pretrained`` and loaded by each run; the embedded tokenizer saved beside it (with ``--model
  smollm2-135m-instruct``, ``benchmarks/real_model.py``: the real pretrained model and its tokenizer instead,
  loaded once from the packaged GGUF file as float32 and saved the same way);
- data: ``--prompts`` synthetic standard (string) prompts of lognormal length (median ``--prompt-median`` words);
- a step: ``--batch-size`` prompts x ``--num-generations`` completions of up to ``--max-completion-length``
  tokens drawn with Hugging Face ``generate`` (temperature 1, KV cache), one reward function (the token sum mod 7,
  so every group has a spread), the DAPO loss with ``beta=0`` in one micro-batch (``steps_per_generation=1``,
  on-policy: no extra pass), AdamW at a constant learning rate, gradient clipping at 1.0, fp32, no checkpointing;
  TRL's ``per_device_train_batch_size`` counts completions (``batch_size x num_generations``), ours prompts;
- timing: each training step from start to end (generation, scoring and training) after ``--warmup-steps``
  untimed steps, in process CPU time on one thread; generated tokens are each step's completion tokens (from the
  logged ``completions/mean_length``, TRL's name in both).

Each run in its own process (its peak resident set size reported), alternating in ``--rounds`` rounds. Headline:
median over rounds of ours / TRL steps per second (target >= 1.0x). Completions are sampled, so the two runs
generate different (equally long on average) completions; the generated tokens per second is the rate that
accounts for it.

Memory (``--memory``): one GRPO step of Qwen3-4B (bf16 weights and AdamW state, bf16 autocast) generating 8
completions of 4,096 tokens for one prompt of 128 tokens with Hugging Face ``generate``, then training on the
8 completions in one padding-free row, planned by ``lit-memtrain plan`` (:mod:`lit_memtrain.planner.generation`:
the training step simulated on fake tensors, the generation phase's KV cache counted), each row adding one
technique to the row above.

Run from the repository root (needs trl)::

    python benchmarks/grpo.py                 # throughput, two rounds (a few minutes on 2 cores)
    python benchmarks/grpo.py --memory        # simulated memory table (about a minute)
    python benchmarks/grpo.py --generation --hidden 128 --max-completion-length 32   # generate vs continuous batching
    python benchmarks/grpo.py --model smollm2-135m-instruct --batch-size 2 --num-generations 4 \
        --max-completion-length 32 --steps 3 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from real_model import MIB, TINY, add_model_option, run_measured, save_real_model

GIB = 2**30


def fail(message: str) -> NoReturn:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(1)


def token_sum_reward(completion_ids=None, completions=None, **kwargs) -> list[float]:
    """Reward of a completion: the sum of its token ids mod 7 (TRL passes ``completion_ids`` as well)."""
    return [float(sum(ids) % 7) for ids in completion_ids]


def worker_trl(args: argparse.Namespace) -> None:
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(args.seed)
    records: dict[str, list] = {"step_cpu_seconds": [], "generated_tokens": []}
    completions = args.batch_size * args.num_generations

    class Timer(TrainerCallback):
        def on_step_begin(self, train_args, state, control, **kwargs):
            self.started = time.process_time()

        def on_step_end(self, train_args, state, control, **kwargs):
            if state.global_step > args.warmup_steps:
                records["step_cpu_seconds"].append(time.process_time() - self.started)

        def on_log(self, train_args, state, control, logs=None, **kwargs):
            if logs and "completions/mean_length" in logs and state.global_step > args.warmup_steps:
                records["generated_tokens"].append(logs["completions/mean_length"] * completions)

    config = GRPOConfig(
        output_dir=args.output + ".trl", per_device_train_batch_size=completions,
        num_generations=args.num_generations, max_completion_length=args.max_completion_length,
        max_steps=args.warmup_steps + args.steps, learning_rate=args.learning_rate, lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, beta=0.0, loss_type="dapo", temperature=1.0,
        use_cpu=True, bf16=False, report_to=[], logging_steps=1, save_strategy="no", seed=args.seed,
        dataloader_num_workers=0, gradient_checkpointing=False, optim="adamw_torch_fused",
    )  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    trainer = GRPOTrainer(
        model=model, reward_funcs=token_sum_reward, args=config,
        processing_class=AutoTokenizer.from_pretrained(args.model_dir),
        train_dataset=datasets.load_dataset("json", data_files=args.data, split="train"), callbacks=[Timer()],
    )  # fmt: skip
    trainer.train()
    Path(args.output).write_text(json.dumps(records))


def worker_ours(args: argparse.Namespace) -> None:
    from lightning.pytorch import Callback, seed_everything

    from lit_memtrain.objectives.grpo import GRPOModule

    seed_everything(args.seed)
    records: dict[str, list] = {"step_cpu_seconds": [], "generated_tokens": []}
    completions = args.batch_size * args.num_generations

    class Timer(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.started = time.process_time()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step > args.warmup_steps:
                records["step_cpu_seconds"].append(time.process_time() - self.started)
                length = float(trainer.callback_metrics["train/completions/mean_length"])
                records["generated_tokens"].append(length * completions)

    module = GRPOModule(
        model=args.model_dir, tokenizer=args.model_dir, dtype="float32", reward_funcs=[token_sum_reward],
        num_generations=args.num_generations, max_completion_length=args.max_completion_length, temperature=1.0,
        policy_loss="dapo", beta=0.0, learning_rate=args.learning_rate, weight_decay=0.0, warmup=0, min_lr_ratio=1.0,
        max_grad_norm=1.0, optimizer={"class_path": "torch.optim.AdamW", "init_args": {"fused": True}},
    )  # fmt: skip
    fit_ours(module, args, Timer(), records)


def fit_ours(module, args: argparse.Namespace, timer, records: dict[str, list]) -> None:
    """Fit ``module`` (ours) on the prompts for the warm-up and timed steps, one CPU process in fp32, ``timer``
    recording into ``records``; write them to ``args.output``."""
    import torch
    from lightning.pytorch import Trainer

    from lit_memtrain.datamodules.prompts import PromptDataModule

    trainer = Trainer(
        max_steps=args.warmup_steps + args.steps, accelerator="cpu", devices=1, precision="32-true", logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[timer],
    )  # fmt: skip
    data = PromptDataModule(tokenizer=args.model_dir, dataset="json", data_files=args.data, max_prompt_length=None,
                            batch_size=args.batch_size, seed=args.seed)  # fmt: skip
    torch.manual_seed(args.seed)
    trainer.fit(module, datamodule=data)
    Path(args.output).write_text(json.dumps(records))


def run_worker(which: str, args: argparse.Namespace, model_dir: Path, data: Path, workdir: Path, tag: str) -> dict:
    options = ["--batch-size", str(args.batch_size), "--num-generations", str(args.num_generations),
               "--max-completion-length", str(args.max_completion_length)]  # fmt: skip
    return run_script(__file__, which, args, model_dir, data, workdir, tag, options)


def run_script(script: str, which: str, args: argparse.Namespace, model_dir: Path, data: Path, workdir: Path, tag: str,
               options: list[str]) -> dict:  # fmt: skip
    """Run ``script``'s ``which`` worker in a process of its own on ``args.threads`` threads, with the shared options
    and ``options``; its records, or exit with the last lines of its log."""
    output = workdir / f"{tag}.json"
    output.unlink(missing_ok=True)
    command = [
        sys.executable, str(Path(script).resolve()), "--worker", which, "--model-dir", str(model_dir), "--data",
        str(data), "--output", str(output), "--steps", str(args.steps), "--warmup-steps", str(args.warmup_steps),
        "--learning-rate", str(args.learning_rate), "--seed", str(args.seed), *options,
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), TOKENIZERS_PARALLELISM="false",
               TRL_EXPERIMENTAL_SILENCE="1")  # fmt: skip
    log = workdir / f"{tag}.log"
    returncode, peak_rss = run_measured(command, env, log)
    if returncode != 0 or not output.exists():
        tail = "\n".join(log.read_text().splitlines()[-30:])
        fail(f"the {which} run exited with {returncode}; last lines of {log}:\n{tail}")
    return {**json.loads(output.read_text()), "peak_rss": peak_rss}


def prepare(args: argparse.Namespace, workdir: Path) -> tuple[Path, Path]:
    """Save one random model (or ``--model``'s real one) and the tokenizer, and the prompts as JSON lines."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from lit_memtrain.datamodules.embedded import EMBEDDED
    from lit_memtrain.datamodules.tokenizer import load_tokenizer
    from lit_memtrain.models.presets import build_config

    model_dir = workdir / "model"
    if args.model != TINY:
        save_real_model(args.model, model_dir)
    else:
        tokenizer = load_tokenizer(EMBEDDED)
        overrides = {"hidden_size": args.hidden, "intermediate_size": 3 * args.hidden,
                     "num_hidden_layers": args.layers, "num_attention_heads": 4, "num_key_value_heads": 2,
                     "head_dim": args.hidden // 4, "vocab_size": len(tokenizer), "pad_token_id": tokenizer.pad_token_id,
                     "eos_token_id": tokenizer.eos_token_id, "bos_token_id": tokenizer.bos_token_id}  # fmt: skip
        torch.manual_seed(args.seed)
        model = AutoModelForCausalLM.from_config(build_config("tiny-qwen3", overrides), dtype=torch.float32)
        model.save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
    rng = np.random.default_rng(args.seed)
    words = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "plus", "is", "what"]
    data = workdir / "prompts.jsonl"
    with data.open("w") as f:
        for length in np.clip(rng.lognormal(np.log(args.prompt_median), 0.5, args.prompts), 2, 64).astype(int):
            f.write(json.dumps({"prompt": " ".join(rng.choice(words, int(length)))}) + "\n")
    return model_dir, data


def compare(runs: dict[str, list[dict]], labels: dict[str, str]) -> None:
    """Print each side's steps/s and generated tokens/s (CPU time, medians over rounds; records of
    ``step_cpu_seconds`` and ``generated_tokens`` per timed step) and ours / TRL round by round."""

    def rates(run: dict) -> tuple[float, float]:
        seconds = sum(run["step_cpu_seconds"])
        return len(run["step_cpu_seconds"]) / seconds, sum(run["generated_tokens"]) / seconds

    print("| | steps / s (CPU time) | generated tokens / s | generated tokens / step | peak RSS MiB |")
    print("|---|---|---|---|---|")
    for name, label in labels.items():
        steps = statistics.median(rates(run)[0] for run in runs[name])
        tokens = statistics.median(rates(run)[1] for run in runs[name])
        per_step = statistics.median(statistics.fmean(run["generated_tokens"]) for run in runs[name])
        peak_rss = statistics.median(run["peak_rss"] for run in runs[name]) / MIB
        print(f"| {label} | {steps:.3f} | {tokens:,.0f} | {per_step:,.0f} | {peak_rss:,.0f} |")
    step_ratios = [rates(o)[0] / rates(t)[0] for o, t in zip(runs["ours"], runs["trl"])]
    token_ratios = [rates(o)[1] / rates(t)[1] for o, t in zip(runs["ours"], runs["trl"])]
    print(f"ours / TRL steps/s: {statistics.median(step_ratios):.2f}x (rounds {', '.join(f'{r:.2f}' for r in step_ratios)}); "
          f"generated tokens/s: {statistics.median(token_ratios):.2f}x (rounds {', '.join(f'{r:.2f}' for r in token_ratios)})")  # fmt: skip


def side_by_side(args: argparse.Namespace, run_worker: Callable[..., dict], labels: dict[str, str], setup: str) -> None:
    """The saved model and prompts (:func:`prepare`), ``run_worker(which, args, model_dir, data, workdir, tag)`` for
    ``"trl"`` and ``"ours"`` once per round, alternating which goes first, then :func:`compare` under ``setup``."""
    started = time.perf_counter()
    runs: dict[str, list[dict]] = {"trl": [], "ours": []}
    with tempfile.TemporaryDirectory(prefix="bench-") as directory:
        workdir = Path(directory)
        model_dir, data = prepare(args, workdir)
        for round_index in range(args.rounds):
            for which in ("trl", "ours") if round_index % 2 == 0 else ("ours", "trl"):
                runs[which].append(run_worker(which, args, model_dir, data, workdir, f"{which}-{round_index}"))
                print(f"round {round_index + 1}: {which} done", file=sys.stderr, flush=True)
    print(setup)
    compare(runs, labels)
    print(f"wall time {time.perf_counter() - started:.0f} s")


def throughput(args: argparse.Namespace) -> None:
    setup = (f"{args.batch_size} prompts x {args.num_generations} completions of up to {args.max_completion_length} "
             f"tokens per step, {args.steps} timed steps, {args.rounds} rounds, {args.threads} thread(s), "
             f"model {args.model}")  # fmt: skip
    side_by_side(args, run_worker, {"trl": "TRL `GRPOTrainer` (HF generate)", "ours": "lit-memtrain `GRPOModule`"},
                 setup)  # fmt: skip


def memory(args: argparse.Namespace) -> None:
    """The Qwen3-4B GRPO step of the module docstring, one technique added per row."""
    from lit_memtrain.planner.simulate import stand_in_device

    stand_in_device()
    from lit_memtrain.planner.fit_config import settings_from_config
    from lit_memtrain.planner.plan import Planner, gpu_budget
    from lit_memtrain.planner.techniques import comparison_rows

    config = {
        "model": {"class_path": "lit_memtrain.GRPOModule", "init_args": {
            "preset": "qwen3-4b", "config_overrides": {"vocab_size": 151936}, "dtype": "bfloat16",
            "loss_type": "nll", "reward_funcs": ["x.y"], "num_generations": 8, "max_completion_length": 4096}},
        "data": {"class_path": "lit_memtrain.datamodules.PromptDataModule",
                 "init_args": {"max_prompt_length": 128, "batch_size": 1}},
        "trainer": {"precision": "bf16-mixed", "callbacks": [
            {"class_path": "lit_memtrain.callbacks.GradientCheckpointing"},
            {"class_path": "lit_memtrain.callbacks.TiledMLP"},
            {"class_path": "lit_memtrain.callbacks.ActivationOffloading"}]},
    }  # fmt: skip
    settings = settings_from_config(config)
    planner = Planner(settings, gpu_budget(80.0), progress=lambda line: print(line, file=sys.stderr, flush=True))
    print("| technique | peak GiB | phase | training GiB | generation GiB |")
    print("|---|---|---|---|---|")
    plain = None
    for name, techniques, note in comparison_rows(settings):
        if techniques is None:
            continue
        step = planner.simulate(techniques, purpose=name)
        peak = step.memory.device_peak / GIB
        plain = plain or peak
        phases = next(n for n in step.notes if n.startswith("GRPO phases"))
        training, generation = (float(part.split(" GiB")[0].split()[-1].replace(",", "")) for part in
                                phases.split(", generation"))  # fmt: skip
        print(f"| {name} | {peak:.1f} ({peak / plain:.2f}x) | {step.memory.phase} | {training:.1f} | {generation:.1f} |")


def generation(args: argparse.Namespace) -> None:
    """Hugging Face ``generate`` against transformers' continuous batching on the CPU, in one process: the same
    model (random ``tiny-qwen3``, hidden ``--hidden``, ``--layers`` layers), ``--batch-size`` prompts of 20 to 27
    tokens x ``--num-generations`` greedy completions of ``--max-completion-length`` tokens (no end of sequence),
    after a warm-up call; the completions are checked equal."""
    import torch
    from transformers import AutoModelForCausalLM

    from lit_memtrain.models.generation import SamplingSettings, TransformersContinuousBatching, TransformersGenerate
    from lit_memtrain.models.presets import build_config

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    shape = {"hidden_size": args.hidden, "intermediate_size": 3 * args.hidden, "num_hidden_layers": args.layers,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": args.hidden // 4, "vocab_size": 512}
    model = AutoModelForCausalLM.from_config(build_config("tiny-qwen3", shape)).train()
    prompts = [list(range(10, 30 + i)) for i in range(args.batch_size)]
    settings = SamplingSettings(max_completion_length=args.max_completion_length, do_sample=False)
    backends = {"generate": TransformersGenerate(settings, [511], 0),
                "continuous batching": TransformersContinuousBatching(settings, [511], 0, page_size=64)}
    results = {}
    print("| backend | CPU s per call | wall s per call | tokens |")
    print("|---|---|---|---|")
    for name, backend in backends.items():
        backend.generate(model, prompts, args.num_generations, torch.device("cpu"), 0)
        cpu, wall = time.process_time(), time.perf_counter()
        results[name] = backend.generate(model, prompts, args.num_generations, torch.device("cpu"), 0)
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        print(f"| {name} | {cpu:.2f} | {wall:.2f} | {sum(map(len, results[name])):,} |")
    print(f"greedy completions equal: {results['generate'] == results['continuous batching']}")


def add_side_by_side_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of :func:`side_by_side` (rounds, steps, the model and prompts, threads) and of its workers."""
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup-steps", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--prompt-median", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--learning-rate", type=float, default=1e-5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    add_model_option(parser)
    parser.add_argument("--worker", choices=("trl", "ours"), help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--output", help=argparse.SUPPRESS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--memory", action="store_true", help="the simulated memory table instead of throughput")
    parser.add_argument("--generation", action="store_true",
                        help="generate against continuous batching on the CPU instead of throughput")
    parser.add_argument("--batch-size", type=int, default=4, help="prompts per step")
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--max-completion-length", type=int, default=48)
    add_side_by_side_arguments(parser)
    args = parser.parse_args()
    if args.worker == "trl":
        worker_trl(args)
    elif args.worker == "ours":
        worker_ours(args)
    elif args.memory:
        memory(args)
    elif args.generation:
        generation(args)
    else:
        throughput(args)


if __name__ == "__main__":
    main()
