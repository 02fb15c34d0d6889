"""``lit-memtrain export``: a Hugging Face directory from a fit checkpoint, any LoRA adapter merged.

The checkpoint's module decides what is written: a causal LM (``CausalLMModule``, ``DPOModule``...) or a
sequence-classification model (``RewardModule``: ``AutoModelForSequenceClassification`` loads it). A checkpoint of
another kind (a plain Lightning checkpoint, a module without ``export``) ends in one line that names it.
"""

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
    except pickle.UnpicklingError as error:  # reported in one line, as a configuration mistake
        raise ValueError(str(error).splitlines()[0]) from error
    if not callable(getattr(module, "export", None)):
        raise ValueError(
            f"{args.checkpoint!r} holds a {type(module).__name__}, which has no export method: lit-memtrain export "
            "writes the model of a lit-memtrain module (CausalLMModule and its subclasses)."
        )
    print(f"exported {args.checkpoint} ({type(module).__name__}) to {module.export(args.output)}")
