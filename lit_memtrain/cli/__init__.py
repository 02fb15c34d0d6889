"""``lit-memtrain``: LightningCLI for ``fit`` / ``validate``, plus small subcommands of our own.

``fit`` and ``validate`` take ``--config configs/*.yaml`` and ``--model.*``, ``--data.*``, ``--trainer.*``
arguments (also in the ``--key=value`` form a W&B sweep agent passes); see :mod:`lit_memtrain.cli.fit`. The other
subcommands live in a file each: ``generate``, ``export``, ``lengths``, ``plan``.
"""

from __future__ import annotations

import importlib
import sys

from lit_memtrain.cli.fit import MemTrainCLI, names_model_class
from lit_memtrain.techniques.allocator import enable_expandable_segments

__all__ = ["MemTrainCLI", "main", "names_model_class"]

# Our own subcommands: the module under lit_memtrain.cli and its function, imported when the subcommand runs.
SUBCOMMANDS = {"generate": "generate", "export": "export", "lengths": "lengths", "plan": "plan"}

_OWN_SUBCOMMANDS_HELP = """
lit-memtrain subcommands of its own:
  generate   answer a prompt with an exported model (lit-memtrain generate --help)
  lengths    token-length profile and a recommended max_length (lit-memtrain lengths --help)
  export     merge a checkpoint's LoRA adapter and write a Hugging Face directory (lit-memtrain export --help)
  plan       simulate a fit configuration's peak GPU memory, and the longest sequence that fits (lit-memtrain plan --help)
"""


def main(argv: list[str] | None = None) -> None:
    """Console entry point. Sets the allocator to expandable segments before anything initialises CUDA."""
    enable_expandable_segments()
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in SUBCOMMANDS:
        name = SUBCOMMANDS[argv[0]]
        getattr(importlib.import_module(f"lit_memtrain.cli.{name}"), name)(argv[1:])
        return
    if argv in ([], ["-h"], ["--help"]):
        print(_OWN_SUBCOMMANDS_HELP)
    from lit_memtrain.cli.fit import run_fit

    run_fit(argv)
