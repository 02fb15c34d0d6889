"""``lit-memtrain evaluate``: the exact-answer accuracy of a model on held-out prompts, by greedy generation."""

from __future__ import annotations

import argparse
import json

from lit_memtrain.cli.generate import add_model_arguments

__all__ = ["evaluate"]


def evaluate(argv: list[str]) -> None:
    from lit_memtrain.datamodules.embedded import ADDITION_HELDOUT
    from lit_memtrain.models.generate import load_model_for, load_tokenizer_for
    from lit_memtrain.objectives.answer_accuracy import load_answer_prompts, score_exact_answers

    parser = argparse.ArgumentParser(
        prog="lit-memtrain evaluate",
        description="Exact-answer accuracy of a model on prompts with verifiable answers, by greedy generation.",
    )
    add_model_arguments(parser)
    parser.add_argument(
        "--dataset", default=ADDITION_HELDOUT,
        help=f"prompts with an 'answer' column (default {ADDITION_HELDOUT}: sums lit-memtrain/addition never asks)",
    )  # fmt: skip
    parser.add_argument(
        "--split", default=None, help="the dataset's held-out split to score (needed when it has several)"
    )
    parser.add_argument(
        "--val_size", type=float, default=0,
        help="score the prompts a fit held out of the split (its data.val_size: a fraction below 1, or a count)",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=42, help="the fit's data.seed, which chose the held-out prompts")
    parser.add_argument("--num_prompts", type=int, default=200, help="how many of the split's first prompts")
    parser.add_argument(
        "--chat_template_kwargs", type=json.loads, default=None, metavar="JSON",
        help='arguments of the chat template, as the fit gave them (e.g. \'{"enable_thinking": false}\')',
    )  # fmt: skip
    parser.add_argument("--max_new_tokens", type=int, default=8)
    parser.add_argument("--batch_size", type=int, default=50, help="prompts generated together")
    args = parser.parse_args(argv)
    rows = load_answer_prompts(args.dataset, args.num_prompts, args.split, args.val_size, args.seed)
    tokenizer = load_tokenizer_for(args.model, args.tokenizer, args.gguf_file)
    score = score_exact_answers(
        load_model_for(args.model, args.gguf_file), tokenizer, rows, args.max_new_tokens, args.batch_size,
        args.chat_template_kwargs,
    )  # fmt: skip
    held = f"held out with val_size={args.val_size:g}, seed={args.seed}" if args.val_size else ""
    split = f" ({', '.join(filter(None, [args.split, held]))})" if args.split or held else ""
    print(f"exact-answer accuracy of {args.model} on {args.num_prompts} prompts of {args.dataset}{split}: {score}")
