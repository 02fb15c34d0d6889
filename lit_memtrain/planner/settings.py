"""What a plan simulates: the parts of a ``fit`` configuration that decide a training step's memory.

Why a plain, JSON-serialisable description rather than the instantiated objects: a simulation must run in
a process of its own (see :mod:`lit_memtrain.planner.simulate`), the comparison and the length search run
the same configuration with techniques switched on and off, and nothing here may load weights or data.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from dataclasses import dataclass, field
from typing import Any, Literal

from lit_memtrain.parallel.dims import ParallelDims

__all__ = [
    "CAUSAL_LM_MODULE",
    "DPO_MODULE",
    "REWARD_MODULE",
    "CallbackSpec",
    "PlanSettings",
    "StrategySpec",
    "import_class",
    "init_defaults",
    "init_parameters",
    "normalise_precision",
]

# The modules whose training step a plan simulates: SFT (cross-entropy), and DPO and reward models (a pair's two
# sequences per step).
CAUSAL_LM_MODULE = "lit_memtrain.objectives.causal_lm.CausalLMModule"
DPO_MODULE = "lit_memtrain.objectives.dpo.DPOModule"
REWARD_MODULE = "lit_memtrain.objectives.reward.RewardModule"
_PAIR_MODULES = (DPO_MODULE, REWARD_MODULE)

_PRECISIONS = {
    "32": "32-true", "32-true": "32-true", "64": "64-true", "64-true": "64-true",
    "16": "16-mixed", "16-mixed": "16-mixed", "16-true": "16-true",
    "bf16": "bf16-mixed", "bf16-mixed": "bf16-mixed", "bf16-true": "bf16-true",
}  # fmt: skip


def normalise_precision(precision: str | int | None) -> str:
    """Lightning's precision names (``"bf16"``, ``16``, ``"32-true"``...) in their unified form.

    Raises:
        ValueError: a precision the planner cannot simulate (``transformer-engine``, an unknown name).
    """
    if precision is None:
        return "32-true"
    name = str(precision)
    if name not in _PRECISIONS:
        raise ValueError(
            f"The planner cannot simulate trainer.precision={precision!r}; it knows "
            f"{sorted(set(_PRECISIONS.values()))} (and Lightning's short forms such as 'bf16' and 16)."
        )
    return _PRECISIONS[name]


def init_parameters(cls: type) -> dict[str, inspect.Parameter]:
    """The ``__init__`` parameters of ``cls`` by name, with those of the classes it passes ``**kwargs`` on to (a
    :class:`~lit_memtrain.objectives.dpo.DPOModule` takes every
    :class:`~lit_memtrain.objectives.causal_lm.CausalLMModule` argument); a subclass's parameter hides its base's."""
    found: dict[str, inspect.Parameter] = {}
    for klass in cls.__mro__:
        if "__init__" not in vars(klass):
            continue
        parameters = list(inspect.signature(klass.__init__).parameters.values())[1:]  # after self
        for p in parameters:
            if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
                found.setdefault(p.name, p)
        if not any(p.kind is p.VAR_KEYWORD for p in parameters):
            break
    return found


def init_defaults(cls: type) -> dict[str, Any]:
    """The default of each ``__init__`` argument of ``cls`` that has one (see :func:`init_parameters`): what a
    configuration that leaves the argument out gets, read from the class that owns it."""
    return {name: p.default for name, p in init_parameters(cls).items() if p.default is not p.empty}


def import_class(class_path: str, what: str) -> type:
    """The class named by ``class_path`` (``package.module.Class``).

    Raises:
        ValueError: it cannot be imported; the message says what it is (``what``: ``"the callback"``...).
    """
    module_name, _, name = class_path.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError, ValueError) as error:
        raise ValueError(f"Cannot import {what} {class_path!r}: {error}") from error


@dataclass(frozen=True)
class CallbackSpec:
    """A callback as LightningCLI configures it: ``class_path`` and ``init_args``."""

    class_path: str
    init_args: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.class_path.rsplit(".", 1)[-1]

    def resolve(self) -> type:
        """The callback class (``package.module.Class``)."""
        return import_class(self.class_path, "the callback")

    def instantiate(self) -> Any:
        return self.resolve()(**self.init_args)


@dataclass(frozen=True)
class StrategySpec:
    """The strategy named by ``trainer.strategy`` and how the planner treats it.

    ``kind``: ``single_device`` (one process), ``ddp`` (every rank holds the whole model and, with
    Lightning's DDP defaults, one more copy of the gradients in its communication buckets), ``fsdp2``
    (:class:`~lit_memtrain.strategies.FSDP2Strategy`: one rank of ``world_size`` is simulated, with torch's
    ``fully_shard`` on a fake process group), ``context_parallel`` (``ContextParallelStrategy``: FSDP2 over all
    ranks, and each sequence split over ``context_parallel_size`` of them), or ``not_simulated`` (another
    sharded strategy: the plan simulates one unsharded device and says so).

    The FSDP2 options (``mixed_precision``, ``reshard_after_forward``, ``cpu_offload``) and the context-parallel
    ones (``context_parallel_size``, ``context_parallel_method``, ``ring_backend``) are the strategy's
    ``init_args``, read without importing the class.
    """

    name: str = "auto"
    world_size: int = 1
    kind: Literal["single_device", "ddp", "fsdp2", "context_parallel", "not_simulated"] = "single_device"
    mixed_precision: str | dict[str, Any] | None = None
    reshard_after_forward: bool = True
    cpu_offload: bool = False
    context_parallel_size: int = 1
    context_parallel_method: str = "ulysses"
    ring_backend: str = "all_gather"

    def __post_init__(self) -> None:
        size = self.parallel_dims.context_parallel_size  # the world size and the group size, and their fit
        if self.context_parallel_method not in ("ulysses", "ring"):
            raise ValueError(
                f"context_parallel_method must be 'ulysses' or 'ring', got {self.context_parallel_method!r}."
            )
        if size > 1 and self.kind not in ("fsdp2", "context_parallel"):
            raise ValueError(
                f"context_parallel_size={size} needs a sharded strategy (lit_memtrain.strategies."
                f"ContextParallelStrategy, or FSDP2Strategy for the plan), but trainer.strategy is {self.name!r}."
            )

    @property
    def parallel_dims(self) -> ParallelDims:
        """The planned run's parallel sizes and mesh, as the strategies make them.

        Raises:
            ValueError: a world size or ``context_parallel_size`` that is not a positive int, or a group size
                that does not divide the world size.
        """
        return ParallelDims(
            self.world_size,
            context_parallel_size=self.context_parallel_size,
            world_size_source="trainer.devices x trainer.num_nodes",
        )

    @property
    def sharded(self) -> bool:
        """Whether one rank of an FSDP2-sharded model is simulated."""
        return self.kind in ("fsdp2", "context_parallel")


@dataclass(frozen=True)
class PlanSettings:
    """One training step's configuration, as far as its memory is concerned.

    Attributes:
        module: :class:`~lit_memtrain.objectives.causal_lm.CausalLMModule` arguments (``model``/``preset``/``config``,
            ``dtype``, ``loss_type``, ``lora``...).
        precision: Lightning's unified precision name (``"bf16-mixed"``, ``"32-true"``...).
        callbacks: the configured callbacks; the technique callbacks (see :mod:`lit_memtrain.planner.techniques`)
            change the step and are simulated, the others are listed as having no effect on its memory.
        max_length: tokens per row.
        batch_size: rows per micro-batch.
        padding_free: rows are flattened into one (packing or ``padding_free``).
        accumulate_grad_batches: micro-batches per optimizer step.
        strategy: the distributed strategy.
        tokenizer: the tokenizer, which must fit inside the model's vocabulary (and fills a config dict's).
        module_class: :data:`CAUSAL_LM_MODULE` (an SFT step: ``batch_size`` rows) or :data:`DPO_MODULE` (a DPO
            step: ``batch_size`` pairs, so ``2 x batch_size`` sequences of up to ``max_length`` tokens each, and
            ``module`` also holds ``beta``, ``preference_loss`` and ``reference``), or :data:`REWARD_MODULE` (a
            reward model's step: ``batch_size`` pairs, as DPO's).
        generation: a GRPO / RLOO fit's generation phase (:class:`~lit_memtrain.planner.generation.GenerationPlan`),
            planned beside the step these settings describe (its training on the completions); None otherwise.
    """

    module: dict[str, Any]
    precision: str = "32-true"
    callbacks: tuple[CallbackSpec, ...] = ()
    max_length: int = 1024
    batch_size: int = 1
    padding_free: bool = False
    accumulate_grad_batches: int = 1
    strategy: StrategySpec = StrategySpec()
    tokenizer: str | None = None
    module_class: str = CAUSAL_LM_MODULE
    generation: Any = None

    def __post_init__(self) -> None:
        if self.module_class not in (CAUSAL_LM_MODULE, *_PAIR_MODULES):
            raise ValueError(
                f"The planner simulates the steps of {CAUSAL_LM_MODULE}, {DPO_MODULE} and {REWARD_MODULE}, got "
                f"module_class={self.module_class!r}."
            )
        if self.preference and self.strategy.context_parallel_size > 1:
            raise ValueError(
                f"{self.module_class.rsplit('.', 1)[-1]} does not support context parallelism (context_parallel_size="
                f"{self.strategy.context_parallel_size}): a pair's log-probabilities or rewards are read from whole "
                "sequences, which sequence shards do not hold. Plan it without context parallelism (FSDP2Strategy, no "
                "--context-parallel-size), with cpu_offload, checkpointing and tiled MLP for long pairs."
            )
        if not any(self.module.get(name) for name in ("model", "preset", "config")):
            raise ValueError(
                "The configuration has no model: set model.model (a hub id or a local directory with config.json), "
                "model.preset (one of lit_memtrain.PRESETS) or model.config (a dict with model_type)."
            )
        if self.max_length < 1:
            raise ValueError(f"data.max_length must be at least 1 token, got {self.max_length}.")
        if self.batch_size < 1 or self.accumulate_grad_batches < 1:
            raise ValueError(
                f"data.batch_size and trainer.accumulate_grad_batches must be at least 1, got {self.batch_size} "
                f"and {self.accumulate_grad_batches}."
            )
        normalise_precision(self.precision)

    @property
    def preference(self) -> bool:
        """Whether the step is DPO's or a reward model's: each of the ``batch_size`` pairs is two sequences (chosen
        and rejected)."""
        return self.module_class in _PAIR_MODULES

    @property
    def sequences(self) -> int:
        """Sequences of one micro-batch: ``batch_size`` rows, or two per pair (DPO, reward models)."""
        return 2 * self.batch_size if self.preference else self.batch_size

    @property
    def tokens_per_step(self) -> int:
        """Tokens of one micro-batch (what one forward and backward hold)."""
        return self.max_length * self.sequences

    def callback(self, kind: type) -> CallbackSpec | None:
        """The first configured callback that is a ``kind`` (a class or a subclass of it)."""
        return next((spec for spec in self.callbacks if issubclass(spec.resolve(), kind)), None)

    def replace(self, **changes: Any) -> PlanSettings:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> PlanSettings:
        values = dict(values)
        values["callbacks"] = tuple(CallbackSpec(**spec) for spec in values.get("callbacks", ()))
        values["strategy"] = StrategySpec(**values.get("strategy", {}))
        return cls(**values)
