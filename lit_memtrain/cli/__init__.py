"""``lit-memtrain``: LightningCLI for ``fit`` / ``validate``, plus small subcommands of our own.

``fit`` and ``validate`` take ``--config configs/*.yaml`` and ``--model.*``, ``--data.*``, ``--trainer.*``
arguments (also in the ``--key=value`` form a W&B sweep agent passes); see :mod:`lit_memtrain.cli.fit`. The other
subcommands live in a file each: ``generate``, ``evaluate``, ``export``, ``lengths``, ``plan``, ``curves``. Every
subcommand ends a configuration mistake with one line and exit status 2 (:mod:`lit_memtrain.cli.errors`).
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import NoReturn

from lit_memtrain.cli.errors import TRACEBACK_VARIABLE, one_line_errors
from lit_memtrain.cli.fit import FIT_SUBCOMMANDS, MemTrainCLI, names_model_class, run_fit
from lit_memtrain.cli.library_noise import silence_library_noise
from lit_memtrain.cli.parse_errors import did_you_mean
from lit_memtrain.techniques.allocator import enable_expandable_segments

__all__ = ["MemTrainCLI", "main", "names_model_class"]

# Our own subcommands: the module under lit_memtrain.cli and its function, imported when the subcommand runs.
SUBCOMMANDS = {
    "generate": "generate", "evaluate": "evaluate", "export": "export", "lengths": "lengths", "plan": "plan",
    "curves": "curves",
}  # fmt: skip

# LightningCLI's subcommands the modules do not implement, with what to run instead.
NOT_IMPLEMENTED = {
    "test": "the modules define no test_step; measure held-out data with `lit-memtrain validate` (its "
    "validation split: --data.val_split or --data.val_size).",
    "predict": "the modules define no predict_step; export the trained model (--model.export_dir, or "
    "`lit-memtrain export`) and answer prompts with `lit-memtrain generate`.",
}

_OWN_SUBCOMMANDS_HELP = f"""
lit-memtrain subcommands of its own:
  generate   answer a prompt with an exported model (lit-memtrain generate --help)
  evaluate   exact-answer accuracy on held-out prompts, by greedy generation (lit-memtrain evaluate --help)
  lengths    token-length profile and a recommended max_length (lit-memtrain lengths --help)
  export     merge a checkpoint's LoRA adapter and write a Hugging Face directory (lit-memtrain export --help)
  plan       simulate a fit configuration's peak GPU memory, and the longest sequence that fits (lit-memtrain plan --help)
  curves     a run's logged metrics against steps, as a PNG from its CSVLogger file (lit-memtrain curves --help)

A configuration mistake ends with one line; {TRACEBACK_VARIABLE}=1 shows its traceback as well.
"""


def main(argv: list[str] | None = None) -> None:
    """Console entry point. Sets the allocator to expandable segments before anything initialises CUDA.

    The working directory goes first on ``sys.path``, as ``python -m`` puts it there: a config names reward functions
    and callbacks by import path (``reward_funcs: [my_rewards.reward_model]``), and a module beside the config must
    import from the ``lit-memtrain`` command as it does from ``python -m lit_memtrain.cli``.
    """
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    enable_expandable_segments()
    silence_library_noise()
    argv = sys.argv[1:] if argv is None else list(argv)
    command = argv[0] if argv else None
    if command in SUBCOMMANDS:
        name = SUBCOMMANDS[command]
        with one_line_errors(f"lit-memtrain {command}"):
            getattr(importlib.import_module(f"lit_memtrain.cli.{name}"), name)(argv[1:])
        return
    if command in NOT_IMPLEMENTED:
        _refuse(f"lit-memtrain {command}", f"lit-memtrain has no {command} subcommand: {NOT_IMPLEMENTED[command]}")
    if command is not None and not command.startswith("-") and command not in FIT_SUBCOMMANDS:
        choices = [*FIT_SUBCOMMANDS, *SUBCOMMANDS]
        _refuse(
            "lit-memtrain",
            f"unknown subcommand {command!r}{did_you_mean(command, choices)}; choose from {', '.join(choices)}.",
        )
    if argv in ([], ["-h"], ["--help"]):
        print(_OWN_SUBCOMMANDS_HELP)
    run_fit(argv)


def _refuse(prog: str, message: str) -> NoReturn:
    print(f"{prog}: error: {message}", file=sys.stderr)
    raise SystemExit(2)
