"""Benchmark: Online DPO with ``OnlineDPOModule`` against TRL's ``OnlineDPOTrainer`` (steps/s, generated tokens/s),
side by side in one run.

The same for both:

- weights: one random ``tiny-qwen3`` (hidden ``--hidden``, ``--layers`` layers, fp32) saved with
  ``save_pretrained`` and loaded by each run, the embedded tokenizer saved beside it; the reference is a frozen
  copy of the initial weights (no LoRA), as each trainer makes it;
- data: ``--prompts`` synthetic string prompts of lognormal length (median ``--prompt-median`` words);
- a step: ``--batch-size`` prompts x 2 completions of up to ``--max-new-tokens`` tokens drawn with Hugging Face
  ``generate`` (temperature 0.9, TRL's default, KV cache), one reward function (the token sum mod 7), the sigmoid
  loss with ``beta=0.1``, the policy and the reference scoring every completion, AdamW (fused) at a constant learning
  rate, gradient clipping at 1.0, fp32, no gradient checkpointing (TRL's default is on: turned off);
- timing: each training step from start to end (generation, judging, both scorings, the optimizer step) after
  ``--warmup-steps`` untimed steps, in process CPU time on ``--threads`` thread(s); generated tokens are each step's
  completion tokens through their end of sequence (TRL's: the completion mask of its ``_generate``; ours: the
  rollout's completions).

Each run in its own process, alternating which goes first in ``--rounds`` rounds. Headline: the median over rounds
of ours / TRL steps per second (target >= 1.0x). Completions are sampled, so the runs generate different
completions; the generated tokens per second is the rate that accounts for it.

The saved model and prompts, the reward, the alternation and the report are ``benchmarks/grpo.py``'s.

Run from the repository root (needs trl)::

    python benchmarks/online_dpo.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from grpo import add_side_by_side_arguments, fit_ours, run_script, side_by_side, token_sum_reward  # its method


def worker_trl(args: argparse.Namespace) -> None:
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer

    torch.manual_seed(args.seed)
    records: dict[str, list] = {"step_cpu_seconds": [], "generated_tokens": []}
    generated: list[int] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, train_args, state, control, **kwargs):
            self.started = time.process_time()
            generated.clear()

        def on_step_end(self, train_args, state, control, **kwargs):
            if state.global_step > args.warmup_steps:
                records["step_cpu_seconds"].append(time.process_time() - self.started)
                records["generated_tokens"].append(sum(generated))

    config = OnlineDPOConfig(
        output_dir=args.output + ".trl", per_device_train_batch_size=args.batch_size,
        max_new_tokens=args.max_new_tokens, max_length=512, beta=0.1, loss_type="sigmoid", temperature=0.9,
        max_steps=args.warmup_steps + args.steps, learning_rate=args.learning_rate, lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, use_cpu=True, bf16=False, report_to=[],
        logging_steps=1, save_strategy="no", seed=args.seed, dataloader_num_workers=0, gradient_checkpointing=False,
        optim="adamw_torch_fused",
    )  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    trainer = OnlineDPOTrainer(
        model=model, reward_funcs=token_sum_reward, args=config,
        processing_class=AutoTokenizer.from_pretrained(args.model_dir),
        train_dataset=datasets.load_dataset("json", data_files=args.data, split="train"), callbacks=[Timer()],
    )  # fmt: skip
    generate = trainer._generate

    def counted(*arguments, **options):
        out = generate(*arguments, **options)
        generated.append(int(out[3].sum()))  # the completion mask: tokens through the first end of sequence
        return out

    trainer._generate = counted
    trainer.train()
    Path(args.output).write_text(json.dumps(records))


def worker_ours(args: argparse.Namespace) -> None:
    from lightning.pytorch import Callback, seed_everything

    from lit_memtrain.objectives.online_dpo import OnlineDPOModule

    seed_everything(args.seed)
    records: dict[str, list] = {"step_cpu_seconds": [], "generated_tokens": []}
    generated: list[int] = []

    class Counted(OnlineDPOModule):
        def _generate_and_score(self, batch, where):
            out = super()._generate_and_score(batch, where)
            generated.append(sum(len(ids) for ids in out[0].completion_ids))
            return out

    class Timer(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.started = time.process_time()
            generated.clear()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step > args.warmup_steps:
                records["step_cpu_seconds"].append(time.process_time() - self.started)
                records["generated_tokens"].append(sum(generated))

    module = Counted(
        model=args.model_dir, tokenizer=args.model_dir, dtype="float32", reward_funcs=[token_sum_reward],
        max_new_tokens=args.max_new_tokens, max_length=512, beta=0.1, preference_loss="sigmoid", temperature=0.9,
        learning_rate=args.learning_rate, weight_decay=0.0, warmup=0, min_lr_ratio=1.0, max_grad_norm=1.0,
        optimizer={"class_path": "torch.optim.AdamW", "init_args": {"fused": True}},
    )  # fmt: skip
    fit_ours(module, args, Timer(), records)


def run_worker(which: str, args: argparse.Namespace, model_dir: Path, data: Path, workdir: Path, tag: str) -> dict:
    options = ["--batch-size", str(args.batch_size), "--max-new-tokens", str(args.max_new_tokens)]
    return run_script(__file__, which, args, model_dir, data, workdir, tag, options)


def throughput(args: argparse.Namespace) -> None:
    setup = (f"{args.batch_size} prompts x 2 completions of up to {args.max_new_tokens} tokens per step, {args.steps} "
             f"timed steps, {args.rounds} rounds, {args.threads} thread(s), model {args.model}")  # fmt: skip
    labels = {"trl": "TRL `OnlineDPOTrainer` (HF generate)", "ours": "lit-memtrain `OnlineDPOModule`"}
    side_by_side(args, run_worker, labels, setup)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-size", type=int, default=8, help="prompts per step")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    add_side_by_side_arguments(parser)
    args = parser.parse_args()
    if args.worker == "trl":
        worker_trl(args)
    elif args.worker == "ours":
        worker_ours(args)
    else:
        throughput(args)


if __name__ == "__main__":
    main()
