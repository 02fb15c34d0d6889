"""Reading a ``fit`` configuration into :class:`~lit_memtrain.planner.settings.PlanSettings`.

Why through LightningCLI's own parser: a plan must read exactly what ``lit-memtrain fit`` reads (the same
``--config`` files, ``--model.*``/``--data.*``/``--trainer.*`` overrides, ``--trainer.callbacks+=``, the
``--key=value`` forms of a sweep agent, the link from ``data.tokenizer`` to ``model.tokenizer``), so it parses
with :class:`lit_memtrain.cli.MemTrainCLI` and stops before anything is instantiated: no tokenizer, dataset,
Trainer or weights are loaded, and a config written for a GPU (``accelerator: gpu``) parses on a laptop.
"""

from __future__ import annotations

from typing import Any

from lit_memtrain.planner.settings import CallbackSpec, PlanSettings, StrategySpec, normalise_precision

__all__ = ["read_fit_config", "settings_from_config", "settings_from_trainer", "strategy_spec"]

_SINGLE_PROCESS = ("single_device", "singledevice", "singledevicestrategy")


def read_fit_config(args: list[str]) -> PlanSettings:
    """Parse ``lit-memtrain fit`` arguments (without the ``fit`` subcommand) into plan settings.

    Example:
        >>> read_fit_config(["--config", "configs/long_context.yaml", "--data.max_length=262144"])  # doctest: +SKIP
    """
    from lit_memtrain.cli import MemTrainCLI
    from lit_memtrain.datamodules.sft import SFTDataModule
    from lit_memtrain.module import CausalLMModule

    class FitConfigReader(MemTrainCLI):
        def add_arguments_to_parser(self, parser) -> None:
            super().add_arguments_to_parser(parser)
            parser.add_argument("--ckpt_path", type=str | None, default=None, help="ignored by the planner")

        def instantiate_classes(self) -> None:
            pass

    reader = FitConfigReader(
        CausalLMModule,
        SFTDataModule,
        args=args,
        run=False,
        auto_configure_optimizers=False,
        save_config_callback=None,
        parser_kwargs={"prog": "lit-memtrain plan", "exit_on_error": False},
    )
    return settings_from_config(reader.config.as_dict())


def settings_from_config(config: dict[str, Any]) -> PlanSettings:
    """Plan settings from a parsed fit configuration (``model``, ``data`` and ``trainer`` sections as dicts)."""
    model = dict(config.get("model") or {})
    data = config.get("data") or {}
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
    )


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
    """Plan settings from a live Trainer, a ``CausalLMModule`` and a datamodule with ``max_length`` and
    ``batch_size`` (``SFTDataModule``), before the model is built (what a callback's ``setup`` sees)."""
    import dataclasses
    import inspect

    from lit_memtrain.module import CausalLMModule
    from lit_memtrain.planner.settings import SIMULATED_CALLBACKS

    accepted = set(inspect.signature(CausalLMModule.__init__).parameters)  # a subclass may add its own
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
