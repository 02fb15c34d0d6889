"""``lit-memtrain export``: a Hugging Face directory from a fit checkpoint, any LoRA adapter merged."""

from __future__ import annotations

import argparse
import pickle

from lit_memtrain.objectives.checkpoint_io import load_checkpoint

__all__ = ["export"]


def export(argv: list[str]) -> None:
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
