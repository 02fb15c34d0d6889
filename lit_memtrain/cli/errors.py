"""A configuration mistake ends a command in one line: ``lit-memtrain <command>: error: <message>``, exit status 2.

Why: a mistake in a configuration (a value a class refuses, an unknown key, a file that is not there, a model or
dataset that cannot be found) already raises an error whose message names it, but the 40-100 lines of traceback
above it, through jsonargparse's and Lightning's machinery, hide it. ``lit-memtrain plan`` always answered in one
line; every subcommand now does.

What counts as a configuration mistake: one of :data:`CONFIGURATION_ERRORS` raised before the first batch runs,
that is while the command parses its arguments, builds its classes and sets the run up (the data, the strategy,
the model, the callbacks' ``on_fit_start``); :class:`RunStarted` marks where that ends. Anything raised once
batches run, and any other exception, is a crash and keeps its whole traceback, as does a configuration error
when ``LIT_MEMTRAIN_TRACEBACK=1`` is set (a bug in set-up code must stay debuggable).
"""

from __future__ import annotations

import os
import sys
from argparse import ArgumentError
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import Callback

__all__ = ["CONFIGURATION_ERRORS", "TRACEBACK_VARIABLE", "RunStarted", "one_line", "one_line_errors"]

TRACEBACK_VARIABLE = "LIT_MEMTRAIN_TRACEBACK"
# OSError: a missing file, a model or dataset that cannot be found; ImportError: an optional package a chosen
# option needs; MisconfigurationException: Lightning's refusals of trainer options (an accelerator not present).
CONFIGURATION_ERRORS = (ValueError, TypeError, OSError, ImportError, ArgumentError, MisconfigurationException)
_UNION_WRAPPER = "Does not validate against any of the Union subtypes"


class RunStarted(Callback):
    """Marks the end of set-up: the first batch of a sanity check, of training or of validation is about to run.

    Lightning's order is data, strategy, ``configure_model``, the callbacks' ``on_fit_start``, then the sanity
    check's ``on_validation_start`` or ``on_train_start``: an error before either is the configuration's.
    """

    def __init__(self) -> None:
        self.started = False

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.started = True

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self.started = True


def one_line(error: BaseException) -> str:
    """``error``'s message on one line; for jsonargparse's "Does not validate against any of the Union subtypes",
    the message of the error a class raised under it."""
    while _UNION_WRAPPER in str(error) and error.__cause__ is not None:
        error = error.__cause__
    text = " ".join(line.strip() for line in str(error).splitlines() if line.strip())
    return text or type(error).__name__


@contextmanager
def one_line_errors(prog: str, run: RunStarted | None = None) -> Iterator[None]:
    """Report a configuration error raised inside as ``<prog>: error: <one line>`` on stderr and exit with status 2.

    Args:
        prog: the command, as its usage names it (``lit-memtrain fit``).
        run: the fit's :class:`RunStarted`; once it has seen a batch start, errors keep their traceback.
    """
    try:
        yield
    except CONFIGURATION_ERRORS as error:
        if (run is not None and run.started) or os.environ.get(TRACEBACK_VARIABLE, "0") not in ("", "0"):
            raise
        print(f"{prog}: error: {one_line(error)}", file=sys.stderr)
        raise SystemExit(2) from None
