"""``lit-memtrain``: LightningCLI for fit/validate, plus small subcommands of our own.

``fit`` and ``validate`` take ``--config configs/*.yaml`` and ``--model.*``, ``--data.*``, ``--trainer.*``
arguments (also in the ``--key=value`` form a W&B sweep agent passes). The tokenizer is given once, as
``data.tokenizer``, and linked to the model so that exports carry it.

The model and data sections hold :class:`CausalLMModule` and :class:`SFTDataModule` arguments, or, when a config
names its classes (``model: {class_path: lit_memtrain.DPOModule, init_args: ...}``, as ``configs/dpo.yaml``
does), any subclass of :class:`CausalLMModule` and any datamodule.
"""

from __future__ import annotations

import argparse
import pickle
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from lightning.pytorch import LightningDataModule
from lightning.pytorch.cli import LightningCLI, LRSchedulerTypeTuple
from torch.optim import Optimizer

from lit_memtrain.allocator import enable_expandable_segments
from lit_memtrain.datamodules.sft import SFTDataModule
from lit_memtrain.module import CausalLMModule, load_checkpoint

_OWN_SUBCOMMANDS_HELP = """
lit-memtrain subcommands of its own:
  generate   answer a prompt with an exported model (lit-memtrain generate --help)
  lengths    token-length profile and a recommended max_length (lit-memtrain lengths --help)
  export     merge a checkpoint's LoRA adapter and write a Hugging Face directory (lit-memtrain export --help)
  plan       simulate a fit configuration's peak GPU memory, and the longest sequence that fits (lit-memtrain plan --help)
"""


def _as_dict(spec: Any) -> dict[str, Any] | None:
    """A parsed ``--optimizer`` / ``--lr_scheduler`` (class_path and init_args) as the module's plain dict."""
    return spec.as_dict() if spec else None


class MemTrainCLI(LightningCLI):
    """LightningCLI for :class:`CausalLMModule` and :class:`SFTDataModule`, or, in subclass mode, for any
    subclass of :class:`CausalLMModule` (such as :class:`~lit_memtrain.dpo.DPOModule`) and any datamodule given
    by ``class_path`` (:func:`main` picks the mode with :func:`names_model_class`).

    ``--optimizer`` / ``--lr_scheduler`` take any ``torch.optim`` optimizer / scheduler (and
    :mod:`lit_memtrain.optim`'s 8-bit and paged AdamW), linked to the module's ``optimizer`` / ``lr_scheduler``
    as Lightning documents for modules that build their own optimizer: the model is built in
    ``configure_model``, after the CLI would instantiate them, and biases and norm weights keep no weight
    decay. Without them: AdamW and warmup-cosine.
    """

    def add_arguments_to_parser(self, parser) -> None:
        model = "model.init_args" if self.subclass_mode_model else "model"
        data = "data.init_args" if self.subclass_mode_data else "data"
        parser.link_arguments(f"{data}.tokenizer", f"{model}.tokenizer")
        parser.add_optimizer_args((Optimizer,), link_to=f"{model}.optimizer")
        parser.add_lr_scheduler_args(LRSchedulerTypeTuple, link_to=f"{model}.lr_scheduler")

    @staticmethod
    def link_optimizers_and_lr_schedulers(parser) -> None:
        """Link each ``--optimizer`` / ``--lr_scheduler`` given a ``link_to`` as a plain dict (Lightning links
        a namespace, which a ``dict`` argument does not accept)."""
        for key, (_, link_to) in {**parser._optimizers, **parser._lr_schedulers}.items():
            if link_to != "AUTOMATIC":
                parser.link_arguments(key, link_to, compute_fn=_as_dict)


def _generate(argv: list[str]) -> None:
    from lit_memtrain.generate import generate_answer, load_tokenizer_for

    parser = argparse.ArgumentParser(prog="lit-memtrain generate", description="Answer prompts with an exported model.")
    parser.add_argument("--model", required=True, help="exported Hugging Face directory")
    parser.add_argument("--prompt", required=True, action="append", help="user message (repeatable)")
    parser.add_argument("--max_new_tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy; above 0: sample at this temperature")
    parser.add_argument("--top_p", type=float, default=1.0, help="nucleus sampling threshold (with --temperature > 0)")
    parser.add_argument("--seed", type=int, default=None, help="seed for sampling")
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory or hub id, when --model has none")
    args = parser.parse_args(argv)
    if args.temperature < 0 or not 0 < args.top_p <= 1:
        parser.error(f"--temperature must be >= 0 and --top_p in (0, 1], got {args.temperature} and {args.top_p}")
    try:
        load_tokenizer_for(args.model, args.tokenizer)
    except ValueError as error:
        parser.error(str(error))
    for prompt in args.prompt:
        answer = generate_answer(
            args.model, prompt, args.max_new_tokens, args.temperature, args.top_p, args.tokenizer, args.seed
        )
        print(f"prompt: {prompt}\nanswer: {answer}")


def _export(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="lit-memtrain export",
        description="Write a Hugging Face directory from a fit checkpoint, merging any LoRA adapter.",
    )
    parser.add_argument(
        "--checkpoint", required=True,
        help="a .ckpt written by lit-memtrain fit, or the directory of a distributed checkpoint (FSDP2Strategy)",
    )
    parser.add_argument("--output", required=True, help="directory to write (save_pretrained layout)")
    args = parser.parse_args(argv)
    try:
        module = load_checkpoint(args.checkpoint)
    except (pickle.UnpicklingError, ValueError) as error:
        parser.error(str(error).splitlines()[0])
    print(f"exported {args.checkpoint} to {module.export(args.output)}")


def _lengths(argv: list[str]) -> None:
    from jsonargparse import ActionConfigFile, ArgumentParser

    from lit_memtrain.datamodules.length_profile import profile_lengths, write_histogram
    from lit_memtrain.datamodules.preference import PreferenceDataModule

    parser = ArgumentParser(
        prog="lit-memtrain lengths",
        description="Token-length profile of a dataset, to choose max_length. Takes the same data options as fit "
        "(and a fit --config, whose model and trainer sections are ignored): SFTDataModule's, or those of the data "
        "class a config names (PreferenceDataModule: each pair's two sequences). Examples are measured untruncated "
        "(a preference prompt is cut to max_prompt_length first, as in training).",
    )
    parser.add_argument("--config", action=ActionConfigFile)
    by_class_path = names_model_class(argv)  # as fit parses the data section
    if by_class_path:
        parser.add_subclass_arguments(LightningDataModule, "data")
    else:
        parser.add_class_arguments(SFTDataModule, "data")
    parser.add_argument("--model", type=dict | None, default=None, help="ignored (fit configs carry it)")
    parser.add_argument("--trainer", type=dict | None, default=None, help="ignored (fit configs carry it)")
    parser.add_argument("--seed_everything", type=int | bool | None, default=None, help="ignored")
    parser.add_argument("--candidates", type=list[int] | None, default=None, help="max_length values to compare")
    parser.add_argument("--max_truncated_token_share", type=float, default=0.01)
    parser.add_argument("--histogram", type=str, default="lengths.png", help="PNG to write")
    parser.add_argument("--sample", type=int, default=10_000, help="examples profiled from a stream (--data.streaming)")
    args = parser.parse_args(argv)
    if by_class_path:
        _check_profiled_data(parser, args.data.class_path)
    data = parser.instantiate_classes(args).data
    pairs = isinstance(data, PreferenceDataModule)
    lengths = data.token_lengths(args.sample if getattr(data, "streaming", False) else None)  # never cut by max_length
    report = profile_lengths(
        lengths,
        args.candidates,
        2 * data.batch_size if pairs else data.batch_size,
        args.max_truncated_token_share,
        configured=data.max_length,
        packing=not pairs,
    )
    if pairs:
        print(_preference_profile_text(data))
    print(report.to_table())
    write_histogram(report, args.histogram)
    print(f"histogram: {args.histogram}")


def _check_profiled_data(parser: Any, class_path: str) -> None:
    """Refuse, before anything is loaded, a data class whose token lengths ``lengths`` cannot measure."""
    import importlib

    from lit_memtrain.datamodules.preference import PreferenceDataModule

    module_name, _, name = class_path.rpartition(".")
    data_class = getattr(importlib.import_module(module_name), name)  # the parser imported it already
    if not issubclass(data_class, (SFTDataModule, PreferenceDataModule)):
        parser.error(
            f"data.class_path is {class_path!r}: lit-memtrain lengths profiles the examples of "
            "lit_memtrain.datamodules.SFTDataModule and PreferenceDataModule, as they tokenize them. Give one of them "
            "as data.class_path, or profile your own token counts with lit_memtrain.datamodules.profile_lengths."
        )


def _preference_profile_text(data: Any) -> str:
    """What the examples of a preference profile are, and what ``max_prompt_length`` cut before it."""
    text = (
        f"Preference pairs: each example below is one sequence, prompt + chosen or prompt + rejected (two per pair; "
        f"a batch of {data.batch_size} pairs is {2 * data.batch_size} sequences, padded or padding-free, never packed)"
    )
    counts = data.token_counts["train"]
    if data.max_prompt_length is None:
        return f"{text}."
    share = counts.truncated_tokens / counts.tokens if counts.tokens else 0.0
    return (
        f"{text}, prompts cut to max_prompt_length={data.max_prompt_length} as in training: {counts.truncated_tokens:,} "
        f"of {counts.tokens:,} tokens ({100 * share:.2f}%) cut from prompts; max_length must stay above "
        f"max_prompt_length."
    )


def _plan(argv: list[str]) -> None:
    from lit_memtrain.planner.command import main as plan

    status = plan(argv)
    if status:
        sys.exit(status)


SUBCOMMANDS: dict[str, Callable[[list[str]], None]] = {
    "generate": _generate,
    "export": _export,
    "lengths": _lengths,
    "plan": _plan,
}


def names_model_class(argv: list[str]) -> bool:
    """Whether the arguments, or a ``--config`` file among them, give the model as a ``class_path``."""
    configs = [value for flag, value in zip(argv, argv[1:]) if flag == "--config"]
    configs += [arg.split("=", 1)[1] for arg in argv if arg.startswith("--config=")]
    if any(arg.startswith(("--model.class_path", "--model=")) for arg in argv):
        return True
    for path in configs:
        if not Path(path).is_file():  # LightningCLI reports it
            continue
        config = yaml.safe_load(Path(path).read_text()) or {}
        if isinstance(config, dict) and isinstance(config.get("model"), dict) and "class_path" in config["model"]:
            return True
    return False


def main(argv: list[str] | None = None) -> None:
    """Console entry point. Sets the allocator to expandable segments before anything initialises CUDA."""
    enable_expandable_segments()
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in SUBCOMMANDS:
        SUBCOMMANDS[argv[0]](argv[1:])
        return
    if argv in ([], ["-h"], ["--help"]):
        print(_OWN_SUBCOMMANDS_HELP)
    by_class_path = names_model_class(argv)
    MemTrainCLI(
        CausalLMModule,
        LightningDataModule if by_class_path else SFTDataModule,
        subclass_mode_model=by_class_path,
        subclass_mode_data=by_class_path,
        save_config_kwargs={"overwrite": True},
        args=argv,
    )


if __name__ == "__main__":
    main()
