"""``lit-memtrain``: LightningCLI for fit/validate, plus small subcommands of our own.

``fit`` and ``validate`` take ``--config configs/*.yaml`` and ``--model.*``, ``--data.*``, ``--trainer.*``
arguments (also in the ``--key=value`` form a W&B sweep agent passes). The tokenizer is given once, as
``data.tokenizer``, and linked to the model so that exports carry it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from lightning.pytorch.cli import LightningCLI

from lit_memtrain.allocator import enable_expandable_segments
from lit_memtrain.datamodules.sft import SFTDataModule
from lit_memtrain.module import CausalLMModule

_OWN_SUBCOMMANDS_HELP = """
lit-memtrain subcommands of its own:
  generate   answer a prompt with an exported model (lit-memtrain generate --help)
  lengths    token-length profile and a recommended max_length (lit-memtrain lengths --help)
  export     merge a checkpoint's LoRA adapter and write a Hugging Face directory (lit-memtrain export --help)
"""


class MemTrainCLI(LightningCLI):
    """LightningCLI for :class:`CausalLMModule` and :class:`SFTDataModule`."""

    def add_arguments_to_parser(self, parser) -> None:
        parser.link_arguments("data.tokenizer", "model.tokenizer")


def _generate(argv: list[str]) -> None:
    from lit_memtrain.generate import generate_answer

    parser = argparse.ArgumentParser(prog="lit-memtrain generate", description="Greedy answer from an exported model.")
    parser.add_argument("--model", required=True, help="exported Hugging Face directory")
    parser.add_argument("--prompt", required=True, action="append", help="user message (repeatable)")
    parser.add_argument("--max_new_tokens", type=int, default=32)
    args = parser.parse_args(argv)
    for prompt in args.prompt:
        print(f"prompt: {prompt}\nanswer: {generate_answer(args.model, prompt, args.max_new_tokens)}")


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
    if Path(args.checkpoint).is_dir():
        module = _load_distributed_checkpoint(Path(args.checkpoint))
    else:
        module = CausalLMModule.load_from_checkpoint(args.checkpoint, map_location="cpu", weights_only=False)
    print(f"exported {args.checkpoint} to {module.export(args.output)}")


def _load_distributed_checkpoint(path: Path) -> CausalLMModule:
    """The module of a distributed checkpoint (a directory of shards and ``meta.pt``), whole, in this process."""
    import torch
    import torch.distributed.checkpoint as dcp

    metadata = torch.load(path / "meta.pt", map_location="cpu", weights_only=False)
    module = CausalLMModule(**metadata["hyper_parameters"])
    module.configure_model()
    state = {"state_dict": module.state_dict()}
    dcp.load(state, checkpoint_id=path, no_dist=True)  # reads the shards of every rank into the full tensors
    module.load_state_dict(state["state_dict"])
    return module


_UNBOUNDED_LENGTH = 2**31 - 1


def _lengths(argv: list[str]) -> None:
    from jsonargparse import ActionConfigFile, ArgumentParser

    from lit_memtrain.datamodules.length_profile import profile_lengths, write_histogram

    parser = ArgumentParser(
        prog="lit-memtrain lengths",
        description="Token-length profile of a dataset, to choose max_length. Takes the same data options as fit "
        "(and a fit --config, whose model and trainer sections are ignored); examples are measured untruncated.",
    )
    parser.add_argument("--config", action=ActionConfigFile)
    parser.add_class_arguments(SFTDataModule, "data")
    parser.add_argument("--model", type=dict | None, default=None, help="ignored (fit configs carry it)")
    parser.add_argument("--trainer", type=dict | None, default=None, help="ignored (fit configs carry it)")
    parser.add_argument("--seed_everything", type=int | bool | None, default=None, help="ignored")
    parser.add_argument("--candidates", type=list[int] | None, default=None, help="max_length values to compare")
    parser.add_argument("--max_truncated_token_share", type=float, default=0.01)
    parser.add_argument("--histogram", type=str, default="lengths.png", help="PNG to write")
    args = parser.parse_args(argv)
    data = parser.instantiate_classes(args).data
    data.max_length, data.packing = _UNBOUNDED_LENGTH, False  # profile whole examples
    data.setup("fit")
    lengths = [len(ids) for ids in data.train_dataset["input_ids"]]
    report = profile_lengths(lengths, args.candidates, data.batch_size, args.max_truncated_token_share)
    print(report.to_table())
    write_histogram(report, args.histogram)
    print(f"histogram: {args.histogram}")


SUBCOMMANDS: dict[str, Callable[[list[str]], None]] = {"generate": _generate, "export": _export, "lengths": _lengths}


def main(argv: list[str] | None = None) -> None:
    """Console entry point. Sets the allocator to expandable segments before anything initialises CUDA."""
    enable_expandable_segments()
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in SUBCOMMANDS:
        SUBCOMMANDS[argv[0]](argv[1:])
        return
    if argv in ([], ["-h"], ["--help"]):
        print(_OWN_SUBCOMMANDS_HELP)
    MemTrainCLI(
        CausalLMModule,
        SFTDataModule,
        save_config_kwargs={"overwrite": True},
        args=argv,
        auto_configure_optimizers=False,
    )


if __name__ == "__main__":
    main()
