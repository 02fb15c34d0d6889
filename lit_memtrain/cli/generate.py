"""``lit-memtrain generate``: answer prompts with an exported Hugging Face directory or a GGUF file."""

from __future__ import annotations

import argparse

__all__ = ["add_model_arguments", "generate"]


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """``--model``, ``--gguf_file`` and ``--tokenizer``: the model a command loads, as ``generate`` and ``evaluate``
    name it."""
    parser.add_argument(
        "--model", required=True,
        help="exported Hugging Face directory or hub id, a .gguf file, or a packaged GGUF (smollm2-135m-instruct)",
    )  # fmt: skip
    parser.add_argument("--gguf_file", default=None, help="the GGUF file in --model's directory or hub repository")
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory, hub id or .gguf, when not --model's")


def generate(argv: list[str]) -> None:
    from lit_memtrain.models.generate import generate_answer, load_model_for, load_tokenizer_for

    parser = argparse.ArgumentParser(prog="lit-memtrain generate", description="Answer prompts with an exported model.")
    add_model_arguments(parser)
    parser.add_argument("--prompt", required=True, action="append", help="user message (repeatable)")
    parser.add_argument("--max_new_tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy; above 0: sample at this temperature")
    parser.add_argument("--top_p", type=float, default=1.0, help="nucleus sampling threshold (with --temperature > 0)")
    parser.add_argument("--seed", type=int, default=None, help="seed for sampling")
    args = parser.parse_args(argv)
    if args.temperature < 0 or not 0 < args.top_p <= 1:
        raise ValueError(f"--temperature must be >= 0 and --top_p in (0, 1], got {args.temperature} and {args.top_p}")
    # the tokenizer first: refuses, before any weight is read, a model it cannot prompt
    tokenizer = load_tokenizer_for(args.model, args.tokenizer, args.gguf_file)
    model = load_model_for(args.model, args.gguf_file)  # read once for all prompts
    for prompt in args.prompt:
        answer = generate_answer(model, prompt, args.max_new_tokens, args.temperature, args.top_p, tokenizer, args.seed)
        print(f"prompt: {prompt}\nanswer: {answer}")
