"""A parsed ``fit`` configuration as :class:`~lit_memtrain.planner.settings.PlanSettings`.

The configuration comes as LightningCLI parses it (:func:`lit_memtrain.cli.plan.read_fit_config`), as plain
dicts: nothing is instantiated, so no tokenizer, dataset, Trainer or weights are loaded. A
config that names its classes (``model: {class_path: lit_memtrain.DPOModule, ...}``, as ``configs/dpo.yaml``
does) is parsed as ``fit`` parses it, and planned when its classes are ones whose step the planner knows:
:class:`~lit_memtrain.objectives.causal_lm.CausalLMModule` on :class:`~lit_memtrain.datamodules.sft.SFTDataModule` rows, or
:class:`~lit_memtrain.objectives.dpo.DPOModule` or :class:`~lit_memtrain.objectives.reward.RewardModule` on
:class:`~lit_memtrain.datamodules.preference.PreferenceDataModule` pairs (or subclasses that keep that step); any
other is refused with what to give instead.

What a configuration leaves out takes the default of the class that owns it, read from its signature (the
datamodule's ``max_length`` and ``batch_size``, the Trainer's, the strategy's). The ``MemoryPlanCheck`` callback
describes its live fit as such a configuration (:mod:`lit_memtrain.callbacks.live_fit`) and hands it to
``python -m lit_memtrain.planner.command --fit-config FILE.json``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from lightning.pytorch import Trainer

from lit_memtrain.planner.settings import (
    CAUSAL_LM_MODULE,
    DPO_MODULE,
    REWARD_MODULE,
    CallbackSpec,
    PlanSettings,
    StrategySpec,
    import_class,
    init_defaults,
    init_parameters,
    normalise_precision,
)

__all__ = ["planned_module_class", "settings_from_config", "strategy_spec"]

_SINGLE_PROCESS = ("single_device", "singledevice", "singledevicestrategy")
# What the simulated step runs of CausalLMModule, DPOModule and RewardModule: a subclass that overrides one of these
# trains differently.
_STEP_METHODS = (
    "training_step", "compute_loss", "_chunked_loss", "_hidden_and_head", "_model_inputs",
    "pair_loss", "pair_terms", "pair_losses", "sequence_logps", "_chunked_token_logps", "batch_reference_logps",
    "sequence_rewards", "_score_sequences", "_score_head",
)  # fmt: skip
# The data each planned module is trained on, whose arguments give the rows of a step.
_DATA_OF = {
    CAUSAL_LM_MODULE: "lit_memtrain.datamodules.sft.SFTDataModule",
    DPO_MODULE: "lit_memtrain.datamodules.preference.PreferenceDataModule",
    REWARD_MODULE: "lit_memtrain.datamodules.preference.PreferenceDataModule",
}


def settings_from_config(config: dict[str, Any]) -> PlanSettings:
    """Plan settings from a parsed fit configuration (``model``, ``data`` and ``trainer`` sections as dicts, each
    the class's arguments or a ``class_path`` and its ``init_args``).

    Raises:
        ValueError: a module or datamodule class whose step the planner does not know, with what to give instead.
    """
    model_class, model = _class_and_arguments(config.get("model"), CAUSAL_LM_MODULE)
    data_class, data = _class_and_arguments(config.get("data"), _DATA_OF[CAUSAL_LM_MODULE])
    if _is_grpo(model_class):  # a generation phase beside an SFT-like step on the completions
        return _grpo_settings(model_class, model, data_class, data, config.get("trainer") or {})
    module_class = planned_module_class(model_class, (config.get("model") or {}).get("overridden_methods", ()))
    expected_data = _DATA_OF[module_class]
    data_type = _resolve(data_class, "data")
    if not any(_class_path(klass) == expected_data for klass in data_type.__mro__):
        raise ValueError(
            f"{module_class.rsplit('.', 1)[-1]} is planned on the batches of {expected_data} (its max_length, "
            f"batch_size and padding-free or padded rows), but data.class_path is {data_class!r}. Plan with "
            f"--data.class_path={expected_data} and the run's max_length and batch_size."
        )
    data = {**init_defaults(data_type), **data}
    trainer = {**init_defaults(Trainer), **(config.get("trainer") or {})}
    accepted = init_parameters(_resolve(module_class, "model"))  # a subclass's own arguments are not the step's
    return PlanSettings(
        module={name: value for name, value in model.items() if name in accepted},
        precision=normalise_precision(trainer["precision"]),
        callbacks=tuple(_callback_spec(entry) for entry in (trainer["callbacks"] or [])),
        max_length=int(data["max_length"]),
        batch_size=int(data["batch_size"]),
        padding_free=bool(data.get("packing")) or bool(data.get("padding_free")),
        accumulate_grad_batches=int(trainer["accumulate_grad_batches"]),
        strategy=strategy_spec(trainer["strategy"], trainer["devices"], trainer["num_nodes"]),
        # the module's (LightningCLI links data.tokenizer to it), or else the datamodule's
        tokenizer=model.get("tokenizer", data.get("tokenizer")),
        module_class=module_class,
    )


def _is_grpo(model_class: str | type) -> bool:
    """An online method's module (GRPO, RLOO, Online DPO): planned with its generation phase."""
    from lit_memtrain.objectives.online_rl import OnlineRLModule

    return issubclass(_resolve(model_class, "model"), OnlineRLModule)


def _grpo_settings(
    model_class: str | type, model: dict[str, Any], data_class: str, data: dict[str, Any], trainer: dict[str, Any]
) -> PlanSettings:
    """A GRPO / RLOO / Online DPO fit's settings (:mod:`lit_memtrain.planner.generation`): its training step and
    generation."""
    from lit_memtrain.planner.generation import grpo_training_settings

    trainer = {**init_defaults(Trainer), **trainer}
    data = {**init_defaults(_resolve(data_class, "data")), **data}
    base = {
        "precision": normalise_precision(trainer["precision"]),
        "callbacks": tuple(_callback_spec(entry) for entry in (trainer["callbacks"] or [])),
        "strategy": strategy_spec(trainer["strategy"], trainer["devices"], trainer["num_nodes"]),
        "tokenizer": model.get("tokenizer", data.get("tokenizer")),
    }
    arguments, _ = grpo_training_settings(_class_path(_resolve(model_class, "model")), model, data, base)
    return PlanSettings(**arguments)


def planned_module_class(model_class: str | type, overridden_methods: Iterable[str] = ()) -> str:
    """The module whose training step the plan simulates for ``model_class`` (a class or its ``class_path``):
    :data:`CAUSAL_LM_MODULE`, :data:`DPO_MODULE` or :data:`REWARD_MODULE`, for that class or a subclass that keeps
    its step.
    ``overridden_methods`` are methods a subclass the planner cannot import (one defined in a training script)
    defines on top of ``model_class``.

    Raises:
        ValueError: another class, or a subclass that overrides what the step runs, with what to plan instead.
    """
    from lit_memtrain.objectives.dpo import DPOModule
    from lit_memtrain.objectives.causal_lm import CausalLMModule
    from lit_memtrain.objectives.reward import RewardModule

    cls = _resolve(model_class, "model")
    base = next((known for known in (DPOModule, RewardModule, CausalLMModule) if issubclass(cls, known)), None)
    if base is None:
        raise ValueError(
            f"model.class_path is {_class_path(cls)!r}: the planner simulates the training steps of "
            "lit_memtrain.CausalLMModule (SFT), lit_memtrain.DPOModule and lit_memtrain.RewardModule only. Give one of "
            "them as model.class_path."
        )
    overridden = [
        name
        for name in _STEP_METHODS
        if getattr(cls, name, None) is not getattr(base, name, None) or name in overridden_methods
    ]
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
    return class_path if isinstance(class_path, type) else import_class(class_path, f"{section}.class_path")


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
_SHARDED = {
    "fsdp2strategy": ("fsdp2", "lit_memtrain.strategies.fsdp2.FSDP2Strategy"),
    "fsdp2": ("fsdp2", "lit_memtrain.strategies.fsdp2.FSDP2Strategy"),
    "contextparallelstrategy": ("context_parallel", "lit_memtrain.strategies.context_parallel.ContextParallelStrategy"),
    "contextparallel": ("context_parallel", "lit_memtrain.strategies.context_parallel.ContextParallelStrategy"),
}


def strategy_spec(strategy: Any, devices: Any = None, num_nodes: Any = None) -> StrategySpec:
    """How the planner treats ``trainer.strategy`` (a name or a class_path/init_args dict).

    The ``init_args`` of ``lit_memtrain.strategies.FSDP2Strategy`` and ``ContextParallelStrategy`` are read as a
    dict over the class's defaults: the class is not instantiated, so a plan needs no process group.
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
    elif lowered in _SHARDED:
        kind, class_path = _SHARDED[lowered]
        init_args = {**init_defaults(import_class(class_path, "trainer.strategy")), **init_args}
        options = {key: init_args[key] for key in _FSDP2_OPTIONS if init_args[key] is not None}
        if kind == "context_parallel":
            options["context_parallel_size"] = int(init_args.get("context_parallel_size", 1))
            options["context_parallel_method"] = str(init_args["method"])
            options["ring_backend"] = str(init_args["ring_backend"])
    else:
        kind = "not_simulated"
    return StrategySpec(name=name, world_size=world_size, kind=kind, **options)
