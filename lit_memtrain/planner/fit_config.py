"""A parsed ``fit`` configuration as :class:`~lit_memtrain.planner.settings.PlanSettings`.

The configuration comes as LightningCLI parses it (:func:`lit_memtrain.cli.plan.read_fit_config`), as plain
dicts: nothing is instantiated, so no tokenizer, dataset, Trainer or weights are loaded. A
config that names its classes (``model: {class_path: lit_memtrain.DPOModule, ...}``, as ``configs/dpo.yaml``
does) is parsed as ``fit`` parses it, and planned when its classes are ones whose step the planner knows:
:class:`~lit_memtrain.objectives.causal_lm.CausalLMModule` on :class:`~lit_memtrain.datamodules.sft.SFTDataModule` rows, or
:class:`~lit_memtrain.objectives.dpo.DPOModule` on :class:`~lit_memtrain.datamodules.preference.PreferenceDataModule` pairs
(or subclasses that keep that step); any other is refused with what to give instead.
"""

from __future__ import annotations

import importlib
from typing import Any

from lit_memtrain.planner.settings import (
    CAUSAL_LM_MODULE,
    DPO_MODULE,
    CallbackSpec,
    PlanSettings,
    StrategySpec,
    init_parameters,
    normalise_precision,
)

__all__ = ["planned_module_class", "settings_from_config", "settings_from_trainer", "strategy_spec"]

_SINGLE_PROCESS = ("single_device", "singledevice", "singledevicestrategy")
# What the simulated step runs of CausalLMModule and DPOModule: a subclass that overrides one of these trains differently.
_STEP_METHODS = (
    "training_step", "compute_loss", "_chunked_loss", "_hidden_and_head", "_model_inputs",
    "pair_loss", "sequence_logps", "_chunked_token_logps", "batch_reference_logps",
)  # fmt: skip
# The data each planned module is trained on, whose arguments give the rows of a step.
_DATA_OF = {
    CAUSAL_LM_MODULE: "lit_memtrain.datamodules.sft.SFTDataModule",
    DPO_MODULE: "lit_memtrain.datamodules.preference.PreferenceDataModule",
}


def settings_from_config(config: dict[str, Any]) -> PlanSettings:
    """Plan settings from a parsed fit configuration (``model``, ``data`` and ``trainer`` sections as dicts, each
    the class's arguments or a ``class_path`` and its ``init_args``).

    Raises:
        ValueError: a module or datamodule class whose step the planner does not know, with what to give instead.
    """
    model_class, model = _class_and_arguments(config.get("model"), CAUSAL_LM_MODULE)
    data_class, data = _class_and_arguments(config.get("data"), _DATA_OF[CAUSAL_LM_MODULE])
    module_class = planned_module_class(model_class)
    expected_data = _DATA_OF[module_class]
    if not any(_class_path(klass) == expected_data for klass in _resolve(data_class, "data").__mro__):
        raise ValueError(
            f"{module_class.rsplit('.', 1)[-1]} is planned on the batches of {expected_data} (its max_length, "
            f"batch_size and padding-free or padded rows), but data.class_path is {data_class!r}. Plan with "
            f"--data.class_path={expected_data} and the run's max_length and batch_size."
        )
    trainer = config.get("trainer") or {}
    callbacks = tuple(_callback_spec(entry) for entry in (trainer.get("callbacks") or []))
    return PlanSettings(
        module=model,
        precision=normalise_precision(trainer.get("precision")),
        callbacks=callbacks,
        max_length=int(data.get("max_length", 1024)),
        batch_size=int(data.get("batch_size", 1)),
        padding_free=bool(data.get("packing")) or bool(data.get("padding_free")),
        accumulate_grad_batches=int(trainer.get("accumulate_grad_batches") or 1),
        strategy=strategy_spec(trainer.get("strategy"), trainer.get("devices"), trainer.get("num_nodes")),
        tokenizer=data.get("tokenizer") or model.get("tokenizer"),
        module_class=module_class,
    )


def planned_module_class(model_class: str | type) -> str:
    """The module whose training step the plan simulates for ``model_class`` (a class or its ``class_path``):
    :data:`CAUSAL_LM_MODULE` or :data:`DPO_MODULE`, for that class or a subclass that keeps its step.

    Raises:
        ValueError: another class, or a subclass that overrides what the step runs, with what to plan instead.
    """
    from lit_memtrain.objectives.dpo import DPOModule
    from lit_memtrain.objectives.causal_lm import CausalLMModule

    cls = _resolve(model_class, "model")
    base = next((known for known in (DPOModule, CausalLMModule) if issubclass(cls, known)), None)
    if base is None:
        raise ValueError(
            f"model.class_path is {_class_path(cls)!r}: the planner simulates the training steps of "
            "lit_memtrain.CausalLMModule (SFT) and lit_memtrain.DPOModule only. Give one of them as model.class_path."
        )
    overridden = [name for name in _STEP_METHODS if getattr(cls, name, None) is not getattr(base, name, None)]
    if overridden:
        raise ValueError(
            f"model.class_path is {_class_path(cls)!r}, which overrides {', '.join(overridden)} of {base.__name__}: "
            f"the planner simulates {base.__name__}'s own training step and cannot know this one. To plan "
            f"{base.__name__}'s step instead, give --model.class_path={_class_path(base)} with the run's model "
            "arguments."
        )
    return _class_path(base)


def _class_and_arguments(section: Any, default_class: str) -> tuple[str, dict[str, Any]]:
    """A config section's class path and arguments: its ``class_path`` and ``init_args``, or ``default_class``
    and the section itself."""
    section = dict(section or {})
    if "class_path" in section:
        return str(section["class_path"]), dict(section.get("init_args") or {})
    return default_class, section


def _resolve(class_path: str | type, section: str) -> type:
    if isinstance(class_path, type):
        return class_path
    module_name, _, name = class_path.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError, ValueError) as error:
        raise ValueError(f"Cannot import {section}.class_path {class_path!r}: {error}") from error


def _class_path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _callback_spec(entry: Any) -> CallbackSpec:
    if isinstance(entry, str):
        return CallbackSpec(entry)
    if isinstance(entry, dict) and "class_path" in entry:
        return CallbackSpec(entry["class_path"], dict(entry.get("init_args") or {}))
    raise ValueError(f"trainer.callbacks entries must be given as class_path/init_args, got {entry!r}.")


def _device_count(devices: Any) -> int:
    if isinstance(devices, (list, tuple)):
        return len(devices)
    if isinstance(devices, str) and "," in devices:
        return len([device for device in devices.split(",") if device.strip()])
    try:
        count = int(devices)
    except (TypeError, ValueError):
        return 1  # "auto" and None: one device per rank is what the plan describes
    return count if count > 0 else 1


_FSDP2_OPTIONS = ("mixed_precision", "reshard_after_forward", "cpu_offload")


def strategy_spec(strategy: Any, devices: Any = None, num_nodes: Any = None) -> StrategySpec:
    """How the planner treats ``trainer.strategy`` (a name or a class_path/init_args dict).

    The ``init_args`` of ``lit_memtrain.strategies.FSDP2Strategy`` and ``ContextParallelStrategy`` are read
    as a dict: the classes are not imported (nor instantiated), so a plan needs neither a process group nor the
    class itself.
    """
    world_size = _device_count(devices) * int(num_nodes or 1)
    options: dict[str, Any] = {}
    if isinstance(strategy, dict):
        name = str(strategy.get("class_path", "")).rsplit(".", 1)[-1]
        init_args = dict(strategy.get("init_args") or {})
    else:
        name = str(strategy or "auto").rsplit(".", 1)[-1]
        init_args = {}
    lowered = name.lower()
    if lowered == "auto":
        kind = "single_device" if world_size == 1 else "ddp"
    elif lowered in _SINGLE_PROCESS:
        kind = "single_device"
    elif lowered.startswith("ddp"):
        kind = "ddp"
    elif lowered in ("fsdp2strategy", "fsdp2", "contextparallelstrategy", "contextparallel"):
        kind = "context_parallel" if lowered.startswith("context") else "fsdp2"
        options = {key: init_args[key] for key in _FSDP2_OPTIONS if init_args.get(key) is not None}
        if kind == "context_parallel":
            options["context_parallel_size"] = int(init_args.get("context_parallel_size", 1))
            options["context_parallel_method"] = str(init_args.get("method", "ulysses"))
            options["ring_backend"] = str(init_args.get("ring_backend", "all_gather"))
    else:
        kind = "not_simulated"
    return StrategySpec(name=name, world_size=world_size, kind=kind, **options)


def settings_from_trainer(trainer: Any, module: Any, datamodule: Any) -> PlanSettings:
    """Plan settings from a live Trainer, a ``CausalLMModule`` or ``DPOModule`` and a datamodule with ``max_length``
    and ``batch_size`` (``SFTDataModule``; ``PreferenceDataModule`` for DPO), before the model is built (what a
    callback's ``setup`` sees).

    Raises:
        ValueError: a module the planner does not simulate, or DPO on other data than ``PreferenceDataModule``.
    """
    import dataclasses
    import inspect

    from lit_memtrain.planner.settings import SIMULATED_CALLBACKS

    module_class = planned_module_class(type(module))
    if module_class == DPO_MODULE and not any(_class_path(k) == _DATA_OF[DPO_MODULE] for k in type(datamodule).__mro__):
        raise ValueError(
            f"A DPO step is planned from the pairs of {_DATA_OF[DPO_MODULE]} (batch_size pairs, two sequences each), "
            f"but the datamodule is {_class_path(type(datamodule))}."
        )
    accepted = init_parameters(_resolve(module_class, "model"))  # a subclass may add arguments of its own
    hparams = {
        name: dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value
        for name, value in dict(module.hparams).items()
        if name in accepted
    }
    callbacks = []
    for callback in trainer.callbacks:
        kind = type(callback)
        init_args = {}
        if isinstance(callback, SIMULATED_CALLBACKS):
            names = [name for name in inspect.signature(kind.__init__).parameters if name != "self"]
            init_args = {name: getattr(callback, name) for name in names if hasattr(callback, name)}
        callbacks.append(CallbackSpec(f"{kind.__module__}.{kind.__qualname__}", init_args))
    padding_free = bool(getattr(datamodule, "padding_free", False) or getattr(datamodule, "packing", False))
    return PlanSettings(
        module=hparams,
        precision=normalise_precision(trainer.precision),
        callbacks=tuple(callbacks),
        max_length=int(datamodule.max_length),
        batch_size=int(datamodule.batch_size),
        padding_free=padding_free,
        accumulate_grad_batches=int(trainer.accumulate_grad_batches),
        strategy=strategy_spec(_live_strategy(trainer.strategy), trainer.num_devices, trainer.num_nodes),
        tokenizer=hparams.get("tokenizer"),
        module_class=module_class,
    )


def _live_strategy(strategy: Any) -> dict[str, Any]:
    """A live strategy as the class_path/init_args dict :func:`strategy_spec` reads (FSDP2 options included)."""
    init_args: dict[str, Any] = {}
    policy = getattr(strategy, "mp_policy", None)
    if policy is not None:
        fields = ("param_dtype", "reduce_dtype", "output_dtype")
        dtypes = {name: getattr(policy, name) for name in fields}
        init_args["mixed_precision"] = {
            name: str(dtype).removeprefix("torch.") for name, dtype in dtypes.items() if dtype is not None
        }
    for name in ("reshard_after_forward", "cpu_offload", "context_parallel_size", "method", "ring_backend"):
        if hasattr(strategy, name):
            init_args[name] = getattr(strategy, name)
    return {"class_path": type(strategy).__name__, "init_args": init_args}
