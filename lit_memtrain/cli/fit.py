"""``lit-memtrain fit`` and ``validate``: LightningCLI for :class:`CausalLMModule` and its subclasses.

``fit`` and ``validate`` take ``--config configs/*.yaml`` and ``--model.*``, ``--data.*``, ``--trainer.*``
arguments (also in the ``--key=value`` form a W&B sweep agent passes). The tokenizer is given once, as
``data.tokenizer``, and linked to the model so that exports carry it.

The model and data sections hold :class:`CausalLMModule` and :class:`SFTDataModule` arguments, or, when a config
names its classes (``model: {class_path: lit_memtrain.DPOModule, init_args: ...}``, as ``configs/dpo.yaml``
does), any subclass of :class:`CausalLMModule` and any datamodule.

As a command (:func:`run_fit`), a configuration mistake ends in one line (:mod:`lit_memtrain.cli.errors`), the
help is plain text (:mod:`lit_memtrain.cli.help_text`) and the model given last wins
(:mod:`lit_memtrain.cli.model_choice`).
"""

from __future__ import annotations

import importlib
import signal
import sys
from argparse import ArgumentError
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml
from lightning.pytorch import LightningDataModule, Trainer
from lightning.pytorch.callbacks import ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, LRSchedulerTypeTuple
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch.optim import Optimizer

from lit_memtrain.callbacks.output_preflight import OutputPreflight
from lit_memtrain.callbacks.run_folder_lock import RunFolderLock
from lit_memtrain.callbacks.sigterm_checkpoint import SigtermCheckpoint
from lit_memtrain.cli.errors import RunStarted, one_line_errors
from lit_memtrain.cli.gguf_tokenizer import use_gguf_tokenizer
from lit_memtrain.cli.library_noise import quiet_loggers
from lit_memtrain.cli.model_choice import replace_earlier_choices
from lit_memtrain.cli.parse_errors import explain_parse_error, parser_keys
from lit_memtrain.cli.progress import StepProgressBar
from lit_memtrain.cli.resume import (
    check_same_configuration,
    continued_loggers,
    readable_checkpoint,
    resume_point,
    stable_checkpoint_folders,
)
from lit_memtrain.datamodules.sft import SFTDataModule
from lit_memtrain.objectives.atomic_checkpoint_io import AtomicCheckpointIO
from lit_memtrain.objectives.causal_lm import CausalLMModule

__all__ = ["FIT_SUBCOMMANDS", "MemTrainCLI", "names_model_class", "run_fit"]

FIT_SUBCOMMANDS = ("fit", "validate")  # the modules define no test_step or predict_step


def _as_dict(spec: Any) -> dict[str, Any] | None:
    """A parsed ``--optimizer`` / ``--lr_scheduler`` (class_path and init_args) as the module's plain dict."""
    return spec.as_dict() if spec else None


def _as_list(callbacks: Any) -> list[Any]:
    if callbacks is None:
        return []
    return list(callbacks) if isinstance(callbacks, (list, tuple)) else [callbacks]


class MemTrainCLI(LightningCLI):
    """LightningCLI for :class:`CausalLMModule` and :class:`SFTDataModule`, or, in subclass mode, for any
    subclass of :class:`CausalLMModule` (such as :class:`~lit_memtrain.objectives.dpo.DPOModule`) and any datamodule given
    by ``class_path`` (:func:`main` picks the mode with :func:`names_model_class`).

    ``--optimizer`` / ``--lr_scheduler`` take any ``torch.optim`` optimizer / scheduler (and
    :mod:`lit_memtrain.objectives.optim`'s 8-bit and paged AdamW), linked to the module's ``optimizer`` / ``lr_scheduler``
    as Lightning documents for modules that build their own optimizer: the model is built in
    ``configure_model``, after the CLI would instantiate them, and biases and norm weights keep no weight
    decay. Without them: AdamW and warmup-cosine.

    Beyond LightningCLI: ``fit`` and ``validate`` are its only subcommands; the model named last among the config
    files and ``--model.*`` arguments wins (:func:`~lit_memtrain.cli.model_choice.replace_earlier_choices`); a GGUF
    model brings its own tokenizer (:func:`~lit_memtrain.cli.gguf_tokenizer.use_gguf_tokenizer`); the
    training bar counts optimizer steps (:class:`~lit_memtrain.cli.progress.StepProgressBar`) unless the trainer
    has a progress bar or none; with ``parser_kwargs={"exit_on_error": False}`` a parse error raises an
    ``ArgumentError`` of one line, with a "did you mean" for a mistyped key.
    """

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        return {name: skip for name, skip in LightningCLI.subcommands().items() if name in FIT_SUBCOMMANDS}

    def add_arguments_to_parser(self, parser) -> None:
        model = "model.init_args" if self.subclass_mode_model else "model"
        data = "data.init_args" if self.subclass_mode_data else "data"
        parser.link_arguments(f"{data}.tokenizer", f"{model}.tokenizer")
        parser.add_optimizer_args((Optimizer,), link_to=f"{model}.optimizer")
        parser.add_lr_scheduler_args(LRSchedulerTypeTuple, link_to=f"{model}.lr_scheduler")

    @staticmethod
    def link_optimizers_and_lr_schedulers(parser) -> None:
        """Link each ``--optimizer`` / ``--lr_scheduler`` given a ``link_to`` as a plain dict (Lightning links
        a namespace, which a ``dict`` argument does not accept)."""
        for key, (_, link_to) in {**parser._optimizers, **parser._lr_schedulers}.items():
            if link_to != "AUTOMATIC":
                parser.link_arguments(key, link_to, compute_fn=_as_dict)

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        """Parse ``args`` (``sys.argv[1:]`` when None) into ``self.config``.

        Unlike LightningCLI's, no warning when ``args`` is given while ``sys.argv`` holds arguments too: the
        console command passes its arguments as ``args``.
        """
        from jsonargparse import Namespace  # imported when a command parses: the package imports without it

        self.given_args = [] if isinstance(args, (dict, Namespace)) else list(sys.argv[1:] if args is None else args)
        try:
            if isinstance(args, (dict, Namespace)):
                self.config = parser.parse_object(args)
            else:
                self.config = parser.parse_args(args)
        except ArgumentError as error:
            parsers = [parser, *getattr(self, "_subcommand_parsers", {}).values()]
            raise ArgumentError(None, explain_parse_error(str(error), parser_keys(*parsers))) from error
        # A strategy's import path alone is the class, as the plan reads it (_strategy_class says why).
        section = self.config[self.config.subcommand] if self.config.get("subcommand") else self.config
        ckpt_path = section.get("ckpt_path")
        if ckpt_path and Path(ckpt_path).exists():  # LightningCLI reads it next, and would end in a traceback
            readable_checkpoint(ckpt_path)
        strategy = section.get("trainer.strategy")
        if isinstance(strategy, str) and _strategy_class(strategy) is not None:
            section["trainer.strategy"] = Namespace(class_path=strategy, init_args=Namespace())

    def before_instantiate_classes(self) -> None:
        section = self.config[self.subcommand] if self.subcommand else self.config
        model = section.get("model")
        if self.subclass_mode_model and model is not None:
            model = model.get("init_args")
        if model is not None:
            replaced = replace_earlier_choices(model, self.given_args)
            if replaced:
                rank_zero_info(replaced)
        data = section.get("data")
        if self.subclass_mode_data and data is not None:
            data = data.get("init_args")
        gguf_tokenizer = use_gguf_tokenizer(model, data)
        if gguf_tokenizer:
            rank_zero_info(gguf_tokenizer)

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        config = self._get(self.config_init, "trainer", default={})
        given = [*_as_list(config.get("callbacks")), *_as_list(self.trainer_defaults.get("callbacks"))]
        wants_bar = config.get("enable_progress_bar") is not False
        if "callbacks" not in kwargs and wants_bar and not any(isinstance(c, ProgressBar) for c in given):
            kwargs["callbacks"] = [*_as_list(config.get("callbacks")), StepProgressBar()]
        trainer = super().instantiate_trainer(**kwargs)
        if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:  # Lightning's default; a user's own is kept
            trainer.strategy.checkpoint_io = AtomicCheckpointIO()
        return trainer

    def before_fit(self) -> None:
        """Prepare the run (:meth:`_before_run`) and settle what it resumes from (:mod:`lit_memtrain.cli.resume`):
        the checkpoint ``--ckpt_path`` (``last``: the newest readable one in the stable checkpoint folder), the
        loggers continuing its run, and the one line saying so."""
        self._before_run()
        section = self.config_init[self.subcommand]
        folders = stable_checkpoint_folders(self.trainer)
        refusal = next(filter(None, map(RunFolderLock.refusal, (f for f in folders if "://" not in f))), None)
        if refusal:  # said before a W&B run or the data start; RunFolderLock holds the folder once the fit starts
            raise FileExistsError(refusal)
        point = resume_point(section.get("ckpt_path"), folders)
        for line in point.warnings:
            rank_zero_warn(line)
        for line in point.lines:
            rank_zero_info(line)
        if point.checkpoint is not None:
            check_same_configuration(point.path, point.checkpoint, self.model, self.datamodule)
            configured = self.config[self.subcommand].get("trainer.logger")
            loggers = continued_loggers(configured, self.trainer.loggers, point.checkpoint)
            if loggers is not None:
                self.trainer.loggers = loggers
        section["ckpt_path"] = point.path

    def before_validate(self) -> None:
        self._before_run()
        stable_checkpoint_folders(self.trainer)  # where ``validate --ckpt_path last`` looks: where fit saved

    def _before_run(self) -> None:
        """Check the data against the strategy before the strategy launches its ranks (each would fail alike), and
        prepare the loggers (:func:`~lit_memtrain.cli.library_noise.quiet_loggers`)."""
        check_datamodule = getattr(self.trainer.strategy, "check_datamodule", None)
        if check_datamodule is not None:
            check_datamodule(self.datamodule)
        quiet_loggers(self.trainer.loggers)


def names_model_class(argv: list[str]) -> bool:
    """Whether the arguments, or a ``--config`` file among them, give the model as a ``class_path``."""
    configs = [value for flag, value in zip(argv, argv[1:]) if flag == "--config"]
    configs += [arg.split("=", 1)[1] for arg in argv if arg.startswith("--config=")]
    if any(arg.startswith(("--model.class_path", "--model=")) for arg in argv):
        return True
    for path in configs:
        if not Path(path).is_file():  # LightningCLI reports it
            continue
        try:
            config = yaml.safe_load(Path(path).read_text()) or {}
        except yaml.YAMLError:  # LightningCLI reports it
            continue
        if isinstance(config, dict) and isinstance(config.get("model"), dict) and "class_path" in config["model"]:
            return True
    return False


def run_fit(argv: list[str]) -> None:
    """LightningCLI's subcommands (``fit``, ``validate``) on ``argv``: CausalLMModule and SFTDataModule arguments, or
    any classes a config names (:func:`names_model_class`). A configuration mistake, up to the first batch, exits
    with status 2 and one line (:func:`~lit_memtrain.cli.errors.one_line_errors`)."""
    subcommand = next((arg for arg in argv if arg in FIT_SUBCOMMANDS), None)
    run = RunStarted()
    from lit_memtrain.cli.help_text import PlainHelpFormatter  # jsonargparse's, imported when a command runs

    parser_kwargs = {"exit_on_error": False, "formatter_class": PlainHelpFormatter}
    with one_line_errors(f"lit-memtrain {subcommand}" if subcommand else "lit-memtrain", run), _sigterm_status():
        by_class_path = names_model_class(argv)
        MemTrainCLI(
            CausalLMModule,
            LightningDataModule if by_class_path else SFTDataModule,
            subclass_mode_model=by_class_path,
            subclass_mode_data=by_class_path,
            save_config_kwargs={"overwrite": True},
            trainer_defaults={"callbacks": [run, SigtermCheckpoint(), RunFolderLock(), OutputPreflight()]},
            parser_kwargs={"prog": "lit-memtrain", **parser_kwargs, **dict.fromkeys(FIT_SUBCOMMANDS, parser_kwargs)},
            args=argv,
        )


@contextmanager
def _sigterm_status() -> Iterator[None]:
    """A fit stopped by SIGTERM (:class:`SigtermCheckpoint` saved it) exits with status 143, as a process the signal
    ended does, not 0 (Lightning's ``SIGTERMException`` is a ``SystemExit`` without a code): it did not finish."""
    try:
        yield
    except SIGTERMException:
        raise SystemExit(128 + signal.SIGTERM) from None


def _strategy_class(name: str) -> type | None:
    """The ``Strategy`` class that ``name`` is the import path of (``lit_memtrain.strategies.FSDP2Strategy``), or
    None for a registered name (``ddp``) or anything else. jsonargparse reads such a path given alone
    (``--trainer.strategy=lit_memtrain.strategies.FSDP2Strategy``, or ``strategy:`` in a config) as a plain string,
    which Lightning then refuses as an unknown strategy name; the plan reads it as the class."""
    module_name, _, class_name = name.rpartition(".")
    if not module_name:
        return None
    try:
        found = getattr(importlib.import_module(module_name), class_name, None)
    except ImportError:
        return None
    return found if isinstance(found, type) and issubclass(found, Strategy) else None
