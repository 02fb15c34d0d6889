"""``lit-memtrain lengths``: the token-length profile of a fit config's training data, to choose ``max_length``."""

from __future__ import annotations

from typing import Any

from lightning.pytorch import LightningDataModule

from lit_memtrain.cli.fit import names_model_class
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
