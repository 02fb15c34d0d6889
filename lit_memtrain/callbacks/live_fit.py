"""A running fit described as the configuration LightningCLI would parse for it, for the memory planner.

Why a configuration and not the planner's own settings: the planner sits above the callbacks
(docs/architecture.md), so a callback hands it what a ``lit-memtrain plan`` user hands it, a fit configuration,
which the planner reads with the same code (:func:`lit_memtrain.planner.fit_config.settings_from_config`), in a
process of its own as a simulation needs. Nothing here knows which arguments the planner reads, or which module
classes it plans: it refuses what it cannot plan, with the reason.

What is described: the module's and the datamodule's class and hyper-parameters (the arguments they were built
with, as ``save_hyperparameters`` keeps them), the Trainer's precision, accumulation, devices and nodes, and the
strategy and each callback by class and by the ``__init__`` arguments of its signature that it keeps as attributes
of the same name. Values a configuration file cannot hold (objects, a callback given to a module) are left out.

A class defined in the training script itself (``__main__``) cannot be imported by name in the planner's process:
it is described as its nearest importable base, and the module's section lists the methods the script's classes
define (``overridden_methods``), so that the planner still refuses a step it does not know.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
from collections.abc import Mapping
from typing import Any

from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.strategies import Strategy

__all__ = ["fit_config", "init_args_of", "strategy_config"]

# What FSDP2's MixedPrecisionPolicy holds in place of the `mixed_precision` argument it was built from.
_POLICY_DTYPES = ("param_dtype", "reduce_dtype", "output_dtype")


def fit_config(trainer: Trainer, pl_module: LightningModule, datamodule: LightningDataModule) -> dict[str, Any]:
    """The fit as a configuration: ``model``, ``data`` and ``trainer`` sections, JSON values only.

    Example:
        >>> config = fit_config(trainer, trainer.lightning_module, trainer.datamodule)  # doctest: +SKIP
        >>> config["data"]["init_args"]["max_length"]  # doctest: +SKIP
        4096
    """
    model_class, overridden = _importable(type(pl_module))
    model = {"class_path": model_class, "init_args": _plain(pl_module.hparams)}
    if overridden:
        model["overridden_methods"] = overridden
    return {
        "model": model,
        "data": {"class_path": _importable(type(datamodule))[0], "init_args": _plain(datamodule.hparams)},
        "trainer": {
            "precision": trainer.precision,
            "accumulate_grad_batches": trainer.accumulate_grad_batches,
            "devices": trainer.num_devices,
            "num_nodes": trainer.num_nodes,
            "strategy": strategy_config(trainer.strategy),
            "callbacks": [
                {"class_path": _importable(type(callback))[0], "init_args": init_args_of(callback)}
                for callback in trainer.callbacks
            ],
        },
    }


def strategy_config(strategy: Strategy) -> dict[str, Any]:
    """A live strategy as ``trainer.strategy``'s class_path and init_args.

    A strategy that keeps an FSDP2 ``mp_policy`` (``FSDP2Strategy``, ``ContextParallelStrategy``) gets its
    ``mixed_precision`` argument back from it, as the dtypes' names.
    """
    init_args = init_args_of(strategy)
    policy = getattr(strategy, "mp_policy", None)
    if policy is not None:
        dtypes = {name: getattr(policy, name, None) for name in _POLICY_DTYPES}
        init_args["mixed_precision"] = {
            name: str(dtype).removeprefix("torch.") for name, dtype in dtypes.items() if dtype is not None
        }
    return {"class_path": _importable(type(strategy))[0], "init_args": init_args}


def init_args_of(obj: object) -> dict[str, Any]:
    """The ``__init__`` arguments of ``obj``'s class that ``obj`` keeps as attributes of the same name (JSON values
    only)."""
    parameters = inspect.signature(type(obj)).parameters.values()
    names = [p.name for p in parameters if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    return _plain({name: getattr(obj, name) for name in names if hasattr(obj, name)})


def _plain(values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` a JSON file can hold (a dataclass as its dict), the others left out."""
    plain = {}
    for name, value in values.items():
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            value = dataclasses.asdict(value)
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            continue
        plain[name] = value
    return plain


def _importable(cls: type) -> tuple[str, list[str]]:
    """The import path of ``cls``, or of its nearest base another process can import when ``cls`` is defined in the
    training script (``__main__``), and the names of the methods the script's classes on the way define."""
    overridden: set[str] = set()
    for klass in cls.__mro__:
        if klass.__module__ != "__main__":
            return f"{klass.__module__}.{klass.__qualname__}", sorted(overridden)
        overridden |= {name for name, value in vars(klass).items() if callable(value)}
    raise AssertionError("every class derives from object")
