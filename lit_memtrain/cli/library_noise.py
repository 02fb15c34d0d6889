"""The lines of library output the command line leaves out, each matched by what it says; nothing else.

Why: a quickstart fit printed 16 lines on stderr, some of them about the libraries rather than the run, with
nothing for a user to do. Each is silenced where it comes from:

- torch 2.13's "`isinstance(treespec, LeafSpec)` is deprecated", which Lightning 2.6's own code triggers (filtered
  by its message, for that Lightning module only), and jsonargparse 4.53's deprecations of the API LightningCLI
  calls (``instantiate_classes``, ``add_instantiator``, ``skip_none``; shown where deprecation warnings are, as under
  ``python -W default``; filtered for ``lightning/pytorch/cli.py`` only): warnings for Lightning's developers;
- Lightning's "TPU available: False, using: 0 TPU cores" (lit-memtrain trains on GPUs and CPUs; its "GPU
  available" line stays), its "Tip" advertising another logging service, and its "Seed set to 0" (the seed is
  the config's ``seed_everything``, and the config LightningCLI saves with the run holds the one drawn for
  ``seed_everything: true``);
- W&B's "The anonymous setting has no effect": Lightning's ``WandbLogger`` passes ``anonymous=None`` to every
  ``wandb.init``, which W&B 0.31 deprecates whatever its value; the ``None`` is left out (W&B ignores it);
- W&B's "git root outputs/... does not exist": W&B looks for a git repository from the logger's ``save_dir``
  before anything created it; it is created first.

The rest stays: device use, data loading and its counts, the attention chosen, the techniques applied, where
W&B keeps the run, why training stopped.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from lightning.pytorch.loggers import WandbLogger

__all__ = ["RANK_ZERO_LOGGER", "quiet_loggers", "silence_library_noise"]

RANK_ZERO_LOGGER = "lightning.pytorch.utilities.rank_zero"  # where Lightning's rank_zero_info lines go
_SEED_LOGGER = "lightning.fabric.utilities.seed"


class _Lines(logging.Filter):
    """Drops the records whose message starts with one of ``starts``."""

    def __init__(self, *starts: str) -> None:
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.starts)


_LIGHTNING_LINES = _Lines("TPU available: ", "💡 Tip: ")
_SEED_LINE = _Lines("Seed set to ")


def silence_library_noise() -> None:
    """Leave out the warnings and log lines listed in the module docstring, for the rest of the process."""
    warnings.filterwarnings(
        "ignore",
        message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
        category=FutureWarning,
        module=r"lightning\.pytorch\.utilities\._pytree",
    )
    warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"lightning\.pytorch\.cli")
    logging.getLogger(RANK_ZERO_LOGGER).addFilter(_LIGHTNING_LINES)  # a filter is added once, however often called
    logging.getLogger(_SEED_LOGGER).addFilter(_SEED_LINE)


def quiet_loggers(loggers: Iterable[Any]) -> None:
    """Prepare a run's W&B loggers so that W&B does not warn about Lightning's way of starting it."""
    for logger in loggers:
        if not isinstance(logger, WandbLogger):
            continue
        init = getattr(logger, "_wandb_init", None)  # the arguments of wandb.init, Lightning's own
        if isinstance(init, dict) and init.get("anonymous", "") is None:
            del init["anonymous"]
        if logger.save_dir:
            Path(logger.save_dir).mkdir(parents=True, exist_ok=True)
