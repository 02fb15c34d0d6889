"""Benchmark: DPO with ``lit-memtrain fit`` against TRL's ``DPOTrainer`` (tokens/s), padding-free against
padded, and the simulated peak memory of a Qwen3-4B DPO step with and without the memory techniques.

Throughput, the same for every run:

- weights: one random ``tiny-qwen3`` (``benchmarks/throughput.py``'s shape: hidden 512, 2 layers, fp32)
  saved with ``save_pretrained`` and loaded by each run; the embedded tokenizer saved beside it (with ``--model
  smollm2-135m-instruct``, ``benchmarks/real_model.py``: the real pretrained model and its tokenizer instead,
  loaded once from the packaged GGUF file as float32 and saved the same way);
- data: ``--pairs`` synthetic standard preference pairs (strings of single-token words): prompts of
  lognormal length (median ``--prompt-median`` tokens), chosen and rejected completions each of lognormal
  length (median ``--completion-median``), clipped so a sequence fits ``--max-length``; eos appended to
  the completions by both frameworks;
- ``--batch-size`` pairs per step (``2 x`` sequences), no gradient accumulation; DPO's sigmoid loss,
  beta 0.1, the reference log-probabilities precomputed in one pass before training (not timed);
- AdamW (fused kernel in both), constant learning rate, gradient clipping at 1.0, no gradient
  checkpointing, fp32 on CPU, attention sdpa in TRL and ours' default for the batch;
- timing: each training step from start to end (ours: ``throughput.StepTimer``; TRL: a
  ``TrainerCallback``), after ``--warmup-steps`` untimed steps; tokens are the real (non-padding) tokens of
  the step's sequences. On one thread the headline uses process CPU time.

Runs: TRL (padded rows: TRL 1.16 disables its padding-free DPO), ours padding-free (the default: every
pair's chosen and rejected sequence in one row) and ours padded, each in its own process (its peak resident set
size reported), in ``--rounds`` rounds that alternate the order (TRL first, then last). Headline: median over
rounds of ours / TRL tokens per second (target >= 1.0x), and padding-free / padded.

Memory (``--memory``): one DPO step of Qwen3-4B (36 layers, bf16 parameters, gradients and AdamW state) on
one pair whose chosen and rejected sequences (L/2 tokens each) fill one padding-free row of L tokens,
simulated with fake tensors (:mod:`lit_memtrain.planner.simulate`: allocations only). The step is DPO's:
the completion log-probabilities (from full logits, or :func:`~lit_memtrain.techniques.logprobs.chunked_token_log_probs`
from hidden states), summed per sequence, the sigmoid loss against precomputed reference log-probabilities
(so no reference model exists), backward and AdamW. Attention is simulated as one causal row of L tokens
(the planner's O(L) flash kernel), an upper bound of the two-document row.

Run from the repository root (needs trl)::

    python benchmarks/dpo.py                 # throughput, three rounds (a few minutes on 2 cores)
    python benchmarks/dpo.py --memory        # simulated memory table (about a minute)
    python benchmarks/dpo.py --model smollm2-135m-instruct --skip-padded --pairs 32 --prompt-median 60 \
        --completion-median 30 --max-length 256 --steps 4 --warmup-steps 1 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import NoReturn

from real_model import MIB, TINY, add_model_option, run_measured, save_real_model

BENCHMARKS = Path(__file__).resolve().parent
GIB = 2**30


def fail(message: str) -> NoReturn:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(1)


# ----------------------------------------------------------------------------------------------- TRL worker


def worker_trl(args: argparse.Namespace) -> None:
    """Train with TRL's DPOTrainer and write the step records to ``args.output``."""
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    datasets.disable_progress_bars()
    records = {"step_seconds": [], "step_cpu_seconds": [], "tokens": [], "losses": []}

    class StepTimerCallback(TrainerCallback):
        def on_step_begin(self, train_args, state, control, **kwargs):
            self.started_at, self.cpu_started_at = time.perf_counter(), time.process_time()

        def on_step_end(self, train_args, state, control, **kwargs):
            records["step_seconds"].append(time.perf_counter() - self.started_at)
            records["step_cpu_seconds"].append(time.process_time() - self.cpu_started_at)

    class CountingDPOTrainer(DPOTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            loss = super().training_step(model, inputs, num_items_in_batch)
            records["tokens"].append(int(inputs["attention_mask"].sum()))
            records["losses"].append(float(loss))
            return loss

    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32, attn_implementation="sdpa")
    config = DPOConfig(
        output_dir=str(Path(args.output).parent / "trl_output"),
        beta=0.1, loss_type=["sigmoid"], precompute_ref_log_probs=True, max_length=args.max_length,
        per_device_train_batch_size=args.batch_size, gradient_accumulation_steps=1,
        max_steps=args.warmup_steps + args.steps, learning_rate=args.learning_rate, lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, optim="adamw_torch_fused", max_grad_norm=1.0,
        activation_checkpointing=False, bf16=False, fp16=False, use_cpu=True, report_to=[], save_strategy="no",
        disable_tqdm=True, dataloader_num_workers=0, seed=args.seed,
    )  # fmt: skip
    dataset = datasets.load_dataset("json", data_files=args.data, split="train")
    trainer = CountingDPOTrainer(
        model=model, args=config, train_dataset=dataset, processing_class=tokenizer, callbacks=[StepTimerCallback()]
    )
    trainer.train()
    Path(args.output).write_text(json.dumps({key: values[args.warmup_steps :] for key, values in records.items()}))


# ------------------------------------------------------------------------------------------------ our runs


def run_ours(args: argparse.Namespace, model_dir: Path, data: Path, workdir: Path, padding_free: bool, tag: str) -> dict:
    import yaml

    output = workdir / f"{tag}.json"
    config = {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "cpu", "devices": 1, "precision": "32-true", "max_steps": args.warmup_steps + args.steps,
            "gradient_clip_val": 1.0, "logger": False, "enable_checkpointing": False, "enable_progress_bar": False,
            "enable_model_summary": False, "limit_val_batches": 0, "num_sanity_val_steps": 0,
            "callbacks": [{"class_path": "throughput.StepTimer",
                           "init_args": {"warmup_steps": args.warmup_steps, "output": str(output)}}],
        },
        "model": {"class_path": "lit_memtrain.DPOModule", "init_args": {
            "model": str(model_dir), "dtype": "float32", "beta": 0.1, "preference_loss": "sigmoid",
            "reference": "precomputed", "learning_rate": args.learning_rate, "weight_decay": 0.0, "warmup": 0,
            "min_lr_ratio": 1.0, "loss_type": "chunked"}},
        "data": {"class_path": "lit_memtrain.datamodules.PreferenceDataModule", "init_args": {
            "tokenizer": str(model_dir), "dataset": str(data), "max_length": args.max_length,
            "batch_size": args.batch_size, "padding_free": padding_free, "seed": args.seed}},
    }  # fmt: skip
    path = workdir / f"{tag}.yaml"
    path.write_text(yaml.safe_dump(config))
    return run_subprocess([sys.executable, "-m", "lit_memtrain.cli", "fit", "--config", str(path)], output, workdir / f"{tag}.log", args.threads)


def run_trl(args: argparse.Namespace, model_dir: Path, data: Path, workdir: Path) -> dict:
    output = workdir / "trl.json"
    command = [
        sys.executable, str(Path(__file__).resolve()), "--worker", "trl", "--model-dir", str(model_dir),
        "--data", str(data), "--output", str(output), "--max-length", str(args.max_length),
        "--batch-size", str(args.batch_size), "--steps", str(args.steps), "--warmup-steps", str(args.warmup_steps),
        "--learning-rate", str(args.learning_rate), "--seed", str(args.seed),
    ]  # fmt: skip
    return run_subprocess(command, output, workdir / "trl.log", args.threads)


def run_subprocess(command: list[str], output: Path, log: Path, threads: int) -> dict:
    output.unlink(missing_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(BENCHMARKS), env.get("PYTHONPATH")]))
    returncode, peak_rss = run_measured(command, env, log)
    if returncode != 0 or not output.exists():
        tail = "\n".join(log.read_text().splitlines()[-30:])
        fail(f"{' '.join(command[:5])} ... exited with {returncode}; last lines of {log}:\n{tail}")
    return {**json.loads(output.read_text()), "peak_rss": peak_rss}


def prepare(args: argparse.Namespace, workdir: Path) -> tuple[Path, Path]:
    """Save one random model (or ``--model``'s real one) and the tokenizer, and the preference pairs as JSON
    lines."""
    import numpy as np
    import torch
    from throughput import MODEL_OVERRIDES, lognormal_lengths, single_token_words
    from transformers import AutoModelForCausalLM

    from lit_memtrain.datamodules.embedded import EMBEDDED
    from lit_memtrain.models.presets import build_config
    from lit_memtrain.datamodules.tokenizer import load_tokenizer

    model_dir = workdir / "model"
    if args.model != TINY:
        tokenizer = load_tokenizer(str(save_real_model(args.model, model_dir)))
    else:
        tokenizer = load_tokenizer(EMBEDDED)
        overrides = {**MODEL_OVERRIDES, "vocab_size": len(tokenizer), "pad_token_id": tokenizer.pad_token_id,
                     "eos_token_id": tokenizer.eos_token_id, "bos_token_id": tokenizer.bos_token_id}
        torch.manual_seed(args.seed)
        model = AutoModelForCausalLM.from_config(build_config("tiny-qwen3", overrides), dtype=torch.float32)
        model.save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
    budget = args.max_length - 1  # eos
    completion = args.max_length // 4
    prompts = lognormal_lengths(args.pairs, args.prompt_median, 0.6, 4, budget - completion, args.seed)
    chosen = lognormal_lengths(args.pairs, args.completion_median, 0.6, 2, completion, args.seed + 1)
    rejected = lognormal_lengths(args.pairs, args.completion_median, 0.6, 2, completion, args.seed + 2)
    vocabulary = np.array([" " + word for word in single_token_words(tokenizer)])
    rng = np.random.default_rng(args.seed)

    def words(n: int) -> str:
        return "".join(rng.choice(vocabulary, int(n)))

    data = workdir / "pairs.jsonl"
    with data.open("w") as f:
        for p, c, r in zip(prompts, chosen, rejected):
            f.write(json.dumps({"prompt": words(p), "chosen": words(c), "rejected": words(r)}) + "\n")
    return model_dir, data


def tokens_per_second(run: dict, clock: str) -> float:
    return sum(run["tokens"]) / sum(run["step_seconds" if clock == "wall" else "step_cpu_seconds"])


def throughput(args: argparse.Namespace) -> None:
    try:
        import trl
    except ImportError:
        fail("trl is not installed: pip install -e '.[bench]'")
    from throughput import print_table

    clock = "cpu" if args.threads == 1 else "wall"
    names = ["trl", "ours, padding-free"] + ([] if args.skip_padded else ["ours, padded"])
    runs: dict[str, list[dict]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory(prefix="dpo_bench_") as directory:
        workdir = Path(directory)
        model_dir, data = prepare(args, workdir)
        print(f"trl {trl.__version__}; model {args.model}; {args.pairs} pairs, {args.batch_size} per step; "
              f"{args.warmup_steps} warm-up + {args.steps} timed steps per run; {args.threads} thread(s); "
              f"{args.rounds} rounds")
        runners = {
            "trl": lambda: run_trl(args, model_dir, data, workdir),
            "ours, padding-free": lambda: run_ours(args, model_dir, data, workdir, True, "ours_free"),
            "ours, padded": lambda: run_ours(args, model_dir, data, workdir, False, "ours_padded"),
        }
        runners = {name: runner for name, runner in runners.items() if name in runs}
        for round_index in range(args.rounds):
            for name in list(runners) if round_index % 2 == 0 else list(runners)[::-1]:
                runs[name].append(runners[name]())
            print(f"round {round_index + 1}: " + ", ".join(
                f"{name} {tokens_per_second(values[-1], clock):,.0f} tokens/s" for name, values in runs.items()))
    for name, values in runs.items():
        if {len(run["tokens"]) for run in values} != {args.steps}:
            fail(f"{name} recorded other than {args.steps} timed steps per run.")
    rows = [("", "tokens/step", f"tokens/s ({clock})", "tokens/s (wall)", "loss, first timed", "loss, last",
             "peak RSS MiB")]
    for name, values in runs.items():
        rows.append((
            name,
            f"{statistics.mean(t for run in values for t in run['tokens']):,.1f}",
            f"{statistics.median(tokens_per_second(run, clock) for run in values):,.0f}",
            f"{statistics.median(tokens_per_second(run, 'wall') for run in values):,.0f}",
            f"{statistics.mean(run['losses'][0] for run in values):.4f}",
            f"{statistics.mean(run['losses'][-1] for run in values):.4f}",
            f"{statistics.median(run['peak_rss'] for run in values) / MIB:,.0f}",
        ))  # fmt: skip
    print_table(rows)

    def ratio(a: str, b: str) -> tuple[float, list[float]]:
        each = [tokens_per_second(x, clock) / tokens_per_second(y, clock) for x, y in zip(runs[a], runs[b])]
        return statistics.median(each), each

    for a, b, target in [("ours, padding-free", "trl", 1.0), ("ours, padded", "trl", None),
                         ("ours, padding-free", "ours, padded", None)]:
        if a not in runs or b not in runs:
            continue
        value, each = ratio(a, b)
        verdict = f"; target >= {target:.2f}x {'met' if value >= target else 'NOT met'}" if target else ""
        print(f"{a} / {b}: {value:.2f}x (rounds {', '.join(f'{r:.2f}' for r in each)}){verdict}")


# ------------------------------------------------------------------------------------------------- memory

MEMORY_ROWS = [
    ("plain (full logits)", {}),
    ("+ checkpointing", {"checkpointing": "full"}),
    ("+ chunked log-probs", {"checkpointing": "full", "chunked": True}),
    ("+ tiled MLP", {"checkpointing": "full", "chunked": True, "tiled_mlp": True}),
    ("+ offloaded checkpoints", {"checkpointing": "offload", "chunked": True, "tiled_mlp": True}),
]


def simulate_dpo_step(length: int, options: dict, layers: int) -> tuple[float, float, float]:
    """Device peak, host peak (GiB) and simulation seconds of one DPO step; run in a process of its own."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from lit_memtrain.techniques.checkpointing import apply_checkpointing
    from lit_memtrain.models.layers import find_decoder_layers
    from lit_memtrain.techniques.logprobs import chunked_token_log_probs, token_log_probs
    from lit_memtrain.planner.simulate import (
        _initialise_optimizer_state,
        fake_causal_lm,
        measure_peak,
        stand_in_device,
        tiles_simulated_once,
    )
    from lit_memtrain.objectives.preference_loss import preference_loss
    from lit_memtrain.models.presets import build_config
    from lit_memtrain.techniques.tiled_mlp import apply_tiled_mlp

    start = time.perf_counter()
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = fake_causal_lm(build_config("qwen3-4b", {"num_hidden_layers": layers}), torch.bfloat16)
        decoder_layers = find_decoder_layers(model)
        if options.get("checkpointing"):
            apply_checkpointing(decoder_layers, offload=options["checkpointing"] == "offload")
        if options.get("tiled_mlp"):
            apply_tiled_mlp(decoder_layers, None)
        adamw = torch.optim.AdamW(model.parameters(), foreach=True)
        _initialise_optimizer_state(model, adamw)
        device = stand_in_device()
        input_ids = torch.zeros((1, length), dtype=torch.long, device=device)
        targets = torch.zeros(length, dtype=torch.long, device=device)
        sequence_ids = (torch.arange(length, device=device) >= length // 2).long()  # chosen, then rejected
        reference = torch.zeros(1, device=device)

        def step() -> None:
            if options.get("chunked"):
                hidden = model.get_decoder()(input_ids=input_ids, use_cache=False).last_hidden_state.flatten(0, 1)
                token_logps = chunked_token_log_probs(hidden, model.get_output_embeddings().weight, targets)
            else:
                token_logps = token_log_probs(model(input_ids=input_ids, use_cache=False).logits.flatten(0, 1), targets)
            sums = token_logps.new_zeros(2).index_add(0, sequence_ids, token_logps)
            preference_loss(sums[:1], sums[1:], reference, reference, beta=0.1).losses.mean().backward()
            adamw.step()
            adamw.zero_grad(set_to_none=True)

        with tiles_simulated_once():
            report = measure_peak(step, model, input_ids, targets, sequence_ids, adamw, model=model)
    return report.device_peak_gib, report.host_peak_gib, time.perf_counter() - start


def memory(args: argparse.Namespace) -> None:
    simulator = multiprocessing.get_context("spawn").Pool(1)  # the stand-in device stays in that process
    print(f"\nSimulated peak device memory of one DPO step, Qwen3-4B ({args.layers} layers, bf16, AdamW), one "
          "pair in one padding-free row of L tokens (chosen and rejected L/2 each), GiB (ratio to plain; host "
          "memory in brackets when used)")
    print("| technique | " + " | ".join(f"{length // 1024}k tokens" for length in args.lengths) + " |")
    print("|---|" + "---|" * len(args.lengths))
    plain: dict[int, float] = {}
    seconds = 0.0
    for name, options in MEMORY_ROWS:
        cells = []
        for length in args.lengths:
            device, host, spent = simulator.apply(simulate_dpo_step, (length, options, args.layers))
            seconds += spent
            plain.setdefault(length, device)
            cells.append(f"{device:.1f} ({device / plain[length]:.2f}x)" + (f" [host {host:.1f}]" if host > 1e-3 else ""))
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
    simulator.close()
    simulator.join()
    print(f"simulated in {seconds:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--memory", action="store_true", help="the simulated memory table instead of throughput")
    parser.add_argument("--lengths", type=int, nargs="+", default=[16384, 65536], help="tokens per step (memory)")
    parser.add_argument("--layers", type=int, default=36, help="decoder layers of the simulated Qwen3-4B")
    parser.add_argument("--pairs", type=int, default=400)
    parser.add_argument("--prompt-median", type=int, default=120)
    parser.add_argument("--completion-median", type=int, default=60)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=4, help="pairs per step")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per run")
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--skip-padded", action="store_true", help="TRL and ours padding-free only (a third less time)")
    parser.add_argument("--seed", type=int, default=0)
    add_model_option(parser)
    parser.add_argument("--worker", choices=["trl"], help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--output", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker == "trl":
        worker_trl(args)
    elif args.memory:
        memory(args)
    else:
        if min(args.steps, args.rounds, args.batch_size, args.threads, args.pairs) < 1 or args.warmup_steps < 0:
            fail("--steps, --rounds, --batch-size, --threads and --pairs must be >= 1 and --warmup-steps >= 0.")
        if args.max_length < 16:
            fail(f"--max-length must be at least 16, got {args.max_length}.")
        throughput(args)


if __name__ == "__main__":
    main()
