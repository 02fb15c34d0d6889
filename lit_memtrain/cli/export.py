"""``lit-memtrain export``: a Hugging Face directory from a fit checkpoint, any LoRA adapter merged.

The checkpoint's module decides what is written: a causal LM (``CausalLMModule``, ``DPOModule``...) or a
sequence-classification model (``RewardModule``: ``AutoModelForSequenceClassification`` loads it). A checkpoint of
another kind (a plain Lightning checkpoint, a module without ``export``) ends in one line that names it.
"""

from __future__ import annotations

import argparse
import pickle
from pathlib import Path

from lit_memtrain.objectives.checkpoint_files import read_checkpoint, unreadable_reason
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
    _check_complete(args.checkpoint)
    try:
        module = load_checkpoint(args.checkpoint)
    except pickle.UnpicklingError as error:  # reported in one line, as a configuration mistake
        raise ValueError(str(error).splitlines()[0]) from error
    if not callable(getattr(module, "export", None)):
        raise ValueError(
            f"{args.checkpoint!r} holds a {type(module).__name__}, which has no export method: lit-memtrain export "
            "writes the model of a lit-memtrain module (CausalLMModule and its subclasses)."
        )
    print(f"exported {args.checkpoint} ({type(module).__name__}) to {module.export(args.output)}")


def _check_complete(checkpoint: str) -> None:
    """Refuse, in one line, a checkpoint file that cannot be read (truncated by a kill or a full disk, empty, not a
    checkpoint); torch's own error names neither the file nor the cause."""
    if not Path(checkpoint).is_file():
        return
    try:
        read_checkpoint(checkpoint)
    except pickle.UnpicklingError:  # a complete file holding code: load_checkpoint says what it holds
        return
    except Exception as error:  # noqa: BLE001 -- any reason is the user's to hear, in one line
        raise ValueError(
            f"--checkpoint {checkpoint} cannot be read: {unreadable_reason(error)}. Export a complete checkpoint "
            "(a save interrupted by a kill or a full disk leaves an incomplete one)."
        ) from None
