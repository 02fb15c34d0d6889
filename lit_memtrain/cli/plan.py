"""``lit-memtrain plan``: will a ``fit`` configuration fit on a GPU, and how long a sequence fits.

Why the fit arguments are read here, with LightningCLI's own parser: a plan must read exactly what
``lit-memtrain fit`` reads (the same ``--config`` files, ``--model.*``/``--data.*``/``--trainer.*`` overrides,
``--trainer.callbacks+=``, the ``--key=value`` forms of a sweep agent, the link from ``data.tokenizer`` to
``model.tokenizer``, the model named last winning over earlier ones), so it parses with
:class:`~lit_memtrain.cli.fit.MemTrainCLI` and stops before anything is instantiated: a config written for a GPU
(``accelerator: gpu``) parses on a laptop. The planner (:mod:`lit_memtrain.planner.command`) does the rest.
"""

from __future__ import annotations

import logging
import sys

from lightning.pytorch import LightningDataModule

from lit_memtrain.cli.fit import MemTrainCLI, names_model_class
from lit_memtrain.cli.library_noise import RANK_ZERO_LOGGER
from lit_memtrain.datamodules.sft import SFTDataModule
from lit_memtrain.objectives.causal_lm import CausalLMModule
from lit_memtrain.planner.fit_config import settings_from_config
from lit_memtrain.planner.settings import PlanSettings

__all__ = ["plan", "read_fit_config"]


class _InfoLines(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno > logging.INFO


def plan(argv: list[str]) -> None:
    """Run ``lit-memtrain plan`` with ``argv``; exits with status 2 for a configuration it cannot plan.

    Once the configuration is read, Lightning's info lines are left out: the planner runs the technique callbacks'
    ``on_fit_start`` once per simulation, and the line each logs there describes a real fit.
    """
    from lit_memtrain.planner.command import main

    rank_zero_log = logging.getLogger(RANK_ZERO_LOGGER)
    quiet = _InfoLines()

    def read_then_quiet(args: list[str]) -> PlanSettings:
        settings = read_fit_config(args)
        rank_zero_log.addFilter(quiet)
        return settings

    try:
        status = main(argv, read_then_quiet)
    finally:
        rank_zero_log.removeFilter(quiet)
    if status:
        sys.exit(status)


def read_fit_config(args: list[str]) -> PlanSettings:
    """Parse ``lit-memtrain fit`` arguments (without the ``fit`` subcommand) into plan settings.

    Example:
        >>> read_fit_config(["--config", "configs/long_context.yaml", "--data.max_length=262144"])  # doctest: +SKIP
    """

    class FitConfigReader(MemTrainCLI):
        def add_arguments_to_parser(self, parser) -> None:
            super().add_arguments_to_parser(parser)
            parser.add_argument("--ckpt_path", type=str | None, default=None, help="ignored by the planner")

        def instantiate_classes(self) -> None:
            pass

    by_class_path = names_model_class(args)  # as `lit-memtrain fit` chooses
    reader = FitConfigReader(
        CausalLMModule,
        LightningDataModule if by_class_path else SFTDataModule,
        subclass_mode_model=by_class_path,
        subclass_mode_data=by_class_path,
        args=args,
        run=False,
        auto_configure_optimizers=False,
        save_config_callback=None,
        parser_kwargs={"prog": "lit-memtrain plan", "exit_on_error": False},
    )
    return settings_from_config(reader.config.as_dict())
