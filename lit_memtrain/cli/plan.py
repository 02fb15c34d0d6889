"""``lit-memtrain plan``: will a ``fit`` configuration fit on a GPU, and how long a sequence fits.

Why the fit arguments are read here, with LightningCLI's own parser: a plan must read exactly what
``lit-memtrain fit`` reads (the same ``--config`` files, ``--model.*``/``--data.*``/``--trainer.*`` overrides,
``--trainer.callbacks+=``, the ``--key=value`` forms of a sweep agent, the link from ``data.tokenizer`` to
``model.tokenizer``), so it parses with :class:`~lit_memtrain.cli.fit.MemTrainCLI` and stops before anything is
instantiated: a config written for a GPU (``accelerator: gpu``) parses on a laptop. The planner
(:mod:`lit_memtrain.planner.command`) does the rest.
"""

from __future__ import annotations

import sys
import warnings

from lightning.pytorch import LightningDataModule

from lit_memtrain.cli.fit import MemTrainCLI, names_model_class
from lit_memtrain.datamodules.sft import SFTDataModule
from lit_memtrain.objectives.causal_lm import CausalLMModule
from lit_memtrain.planner.fit_config import settings_from_config
from lit_memtrain.planner.settings import PlanSettings

__all__ = ["plan", "read_fit_config"]


def plan(argv: list[str]) -> None:
    """Run ``lit-memtrain plan`` with ``argv``; exits with status 2 for a configuration it cannot plan."""
    from lit_memtrain.planner.command import main

    status = main(argv, read_fit_config)
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
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
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
