"""``lit-memtrain lengths``: the token-length profile of a fit config's training data, to choose ``max_length``."""

from __future__ import annotations

from argparse import ArgumentError
from typing import Any

from lightning.pytorch import LightningDataModule

from lit_memtrain.cli.fit import names_model_class
from lit_memtrain.cli.gguf_tokenizer import use_gguf_tokenizer
from lit_memtrain.cli.help_text import PlainHelpFormatter
from lit_memtrain.cli.parse_errors import explain_parse_error, parser_keys
from lit_memtrain.datamodules.sft import SFTDataModule

__all__ = ["lengths"]


def lengths(argv: list[str]) -> None:
    from jsonargparse import ActionConfigFile, ArgumentParser

    from lit_memtrain.datamodules.length_profile import profile_lengths, write_histogram
    from lit_memtrain.datamodules.preference import PreferenceDataModule

    parser = ArgumentParser(
        prog="lit-memtrain lengths",
        description="Token-length profile of a dataset, to choose max_length. Takes the same data options as fit "
        "(and a fit --config, whose model and trainer sections are ignored): SFTDataModule's, or those of the data "
        "class a config names (PreferenceDataModule: each pair's two sequences). Examples are measured untruncated "
        "(a preference prompt is cut to max_prompt_length first, as in training).",
        exit_on_error=False,  # a parse error is reported in one line (lit_memtrain.cli.errors)
        formatter_class=PlainHelpFormatter,
    )
    parser.add_argument("--config", action=ActionConfigFile)
    by_class_path = names_model_class(argv)  # as fit parses the data section
    if by_class_path:
        parser.add_subclass_arguments(LightningDataModule, "data")
    else:
        parser.add_class_arguments(SFTDataModule, "data")
    parser.add_argument(
        "--model", type=dict | None, default=None, help="ignored (fit configs carry it) but a GGUF model's tokenizer"
    )
    parser.add_argument("--trainer", type=dict | None, default=None, help="ignored (fit configs carry it)")
    parser.add_argument("--seed_everything", type=int | bool | None, default=None, help="ignored")
    parser.add_argument("--candidates", type=list[int] | None, default=None, help="max_length values to compare")
    parser.add_argument("--max_truncated_token_share", type=float, default=0.01)
    parser.add_argument("--histogram", type=str, default="token_lengths.png", help="PNG to write (in the working directory)")
    parser.add_argument("--sample", type=int, default=10_000, help="examples profiled from a stream (--data.streaming)")
    try:
        args = parser.parse_args(argv)
    except ArgumentError as error:
        raise ArgumentError(None, explain_parse_error(str(error), parser_keys(parser))) from error
    if by_class_path:
        _check_profiled_data(parser, args.data.class_path)
    model = args.model.get("init_args", args.model) if args.model else None
    gguf_tokenizer = use_gguf_tokenizer(model, args.data.init_args if by_class_path else args.data)
    if gguf_tokenizer:
        print(gguf_tokenizer)
    data = parser.instantiate(args).data
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
    """What the examples of a preference profile are, what ``max_prompt_length`` cut before it, and how many
    pairs training drops at ``max_length`` (:attr:`~lit_memtrain.datamodules.preference.PreferenceDataModule.
    dropped_pairs` says which) though the profile counts them."""
    text = (
        f"Preference pairs: each example below is one sequence, prompt + chosen or prompt + rejected (two per pair; "
        f"a batch of {data.batch_size} pairs is {2 * data.batch_size} sequences, padded or padding-free, never packed)"
    )
    counts = data.token_counts["train"]
    if data.max_prompt_length is not None:
        share = counts.truncated_tokens / counts.tokens if counts.tokens else 0.0
        text = (
            f"{text}, prompts cut to max_prompt_length={data.max_prompt_length} as in training: "
            f"{counts.truncated_tokens:,} of {counts.tokens:,} tokens ({100 * share:.2f}%) cut from prompts "
            f"(prompt_truncation={data.prompt_truncation}); max_length must stay above max_prompt_length"
        )
    if counts.dropped_examples:
        text = (
            f"{text}. At max_length={data.max_length} training drops {counts.dropped_examples:,} of "
            f"{counts.examples:,} pairs ({counts.dropped_tokens:,} tokens), pairs {data.dropped_pairs}; the table "
            "counts their sequences as cut at max_length instead"
        )
    return f"{text}."
