"""``lit-memtrain fit`` and ``validate``: LightningCLI for :class:`CausalLMModule` and its subclasses.

``fit`` and ``validate`` take ``--config configs/*.yaml`` and ``--model.*``, ``--data.*``, ``--trainer.*``
arguments (also in the ``--key=value`` form a W&B sweep agent passes). The tokenizer is given once, as
``data.tokenizer``, and linked to the model so that exports carry it.

The model and data sections hold :class:`CausalLMModule` and :class:`SFTDataModule` arguments, or, when a config
names its classes (``model: {class_path: lit_memtrain.DPOModule, init_args: ...}``, as ``configs/dpo.yaml``
does), any subclass of :class:`CausalLMModule` and any datamodule.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from lightning.pytorch import LightningDataModule
from lightning.pytorch.cli import LightningCLI, LRSchedulerTypeTuple
from torch.optim import Optimizer

from lit_memtrain.datamodules.sft import SFTDataModule
from lit_memtrain.objectives.causal_lm import CausalLMModule

__all__ = ["MemTrainCLI", "names_model_class", "run_fit"]


def _as_dict(spec: Any) -> dict[str, Any] | None:
    """A parsed ``--optimizer`` / ``--lr_scheduler`` (class_path and init_args) as the module's plain dict."""
    return spec.as_dict() if spec else None


class MemTrainCLI(LightningCLI):
    """LightningCLI for :class:`CausalLMModule` and :class:`SFTDataModule`, or, in subclass mode, for any
    subclass of :class:`CausalLMModule` (such as :class:`~lit_memtrain.objectives.dpo.DPOModule`) and any datamodule given
    by ``class_path`` (:func:`main` picks the mode with :func:`names_model_class`).

    ``--optimizer`` / ``--lr_scheduler`` take any ``torch.optim`` optimizer / scheduler (and
    :mod:`lit_memtrain.objectives.optim`'s 8-bit and paged AdamW), linked to the module's ``optimizer`` / ``lr_scheduler``
    as Lightning documents for modules that build their own optimizer: the model is built in
    ``configure_model``, after the CLI would instantiate them, and biases and norm weights keep no weight
    decay. Without them: AdamW and warmup-cosine.
    """

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


def names_model_class(argv: list[str]) -> bool:
    """Whether the arguments, or a ``--config`` file among them, give the model as a ``class_path``."""
    configs = [value for flag, value in zip(argv, argv[1:]) if flag == "--config"]
    configs += [arg.split("=", 1)[1] for arg in argv if arg.startswith("--config=")]
    if any(arg.startswith(("--model.class_path", "--model=")) for arg in argv):
        return True
    for path in configs:
        if not Path(path).is_file():  # LightningCLI reports it
            continue
        config = yaml.safe_load(Path(path).read_text()) or {}
        if isinstance(config, dict) and isinstance(config.get("model"), dict) and "class_path" in config["model"]:
            return True
    return False


def run_fit(argv: list[str]) -> None:
    """LightningCLI's subcommands (``fit``, ``validate``) on ``argv``: CausalLMModule and SFTDataModule arguments, or
    any classes a config names (:func:`names_model_class`)."""
    by_class_path = names_model_class(argv)
    MemTrainCLI(
        CausalLMModule,
        LightningDataModule if by_class_path else SFTDataModule,
        subclass_mode_model=by_class_path,
        subclass_mode_data=by_class_path,
        save_config_kwargs={"overwrite": True},
        args=argv,
    )
