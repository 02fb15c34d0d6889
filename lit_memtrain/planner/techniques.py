"""A configuration's memory techniques, switched on and off for the comparison and the suggestions.

Why the techniques are learnt from the callbacks: ``--compare`` replays the same model, precision and batch with
the techniques added one at a time, and a plan that does not fit says which technique to add. Most techniques are
callbacks, and each describes itself
(:meth:`~lit_memtrain.callbacks.technique_description.PlannedTechnique.describe_for_planner`): its words, its rows
and its suggestions. The technique callbacks are those :mod:`lit_memtrain.callbacks` exports and those the
configuration names (a user's own), found by that method; nothing here lists them. The planner's own techniques are
those that are not callbacks: the module's chunked loss, and for the sharded strategies (FSDP2, context parallel)
``cpu_offload`` and the context-parallel size.

Options the user gave a technique callback (``layers_path``, ``num_tiles``, offloading thresholds) are kept when
the technique is added by a row or a suggestion.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lightning.pytorch import Callback

import lit_memtrain.callbacks
from lit_memtrain.callbacks.technique_description import PlannedTechnique, TechniqueDescription
from lit_memtrain.planner.settings import REWARD_MODULE, CallbackSpec, PlanSettings, import_class, init_defaults

__all__ = ["Techniques", "comparison_rows", "is_technique", "suggestions", "techniques_of", "with_techniques"]

# Where the planner's own techniques go (see lit_memtrain.callbacks.technique_description).
_CHUNKED_LOSS, _CPU_OFFLOAD, _CONTEXT_PARALLEL = 20, 60, 70
_SUGGESTED_CHUNKED_LOSS, _SUGGESTED_CPU_OFFLOAD = 20, 70


def is_technique(cls: type) -> bool:
    """Whether ``cls`` is a technique callback: a callback the planner simulates, as it describes itself."""
    return issubclass(cls, Callback) and issubclass(cls, PlannedTechnique)


def _class_path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _spec(kind: type, init_args: dict[str, Any]) -> CallbackSpec:
    """``kind`` with the arguments that differ from its defaults: two ways of writing one callback are one spec."""
    defaults = init_defaults(kind)
    changed = {name: value for name, value in init_args.items() if name not in defaults or defaults[name] != value}
    return CallbackSpec(_class_path(kind), changed)


def _description(spec: CallbackSpec) -> TechniqueDescription:
    return spec.instantiate().describe_for_planner()


@dataclass(frozen=True)
class Techniques:
    """The memory techniques of a configuration.

    Attributes:
        callbacks: its technique callbacks, each with the arguments that differ from its defaults, in the order of
            their descriptions.
        chunked_loss: the module's ``loss_type`` is ``chunked``.
        cpu_offload: the sharded strategy keeps parameters, gradients and optimizer state in host memory.
        context_parallel_size: ranks each sequence is split over.
    """

    callbacks: tuple[CallbackSpec, ...] = ()
    chunked_loss: bool = False
    cpu_offload: bool = False
    context_parallel_size: int = 1

    def __hash__(self) -> int:  # a simulation's key: its arguments are JSON values, compared by their text
        return hash(json.dumps(dataclasses.asdict(self), sort_keys=True, default=repr))

    def callback(self, kind: type) -> CallbackSpec | None:
        """The technique callback that is a ``kind`` (a class or a subclass of it), if on."""
        return next((spec for spec in self.callbacks if issubclass(spec.resolve(), kind)), None)

    def with_callback(self, spec: CallbackSpec) -> Techniques:
        """These techniques with ``spec`` in place of the callback of its class, or added."""
        kind = spec.resolve()
        callbacks = [other for other in self.callbacks if other.resolve() is not kind]
        callbacks.append(_spec(kind, spec.init_args))
        callbacks.sort(key=lambda other: _description(other).order)
        return dataclasses.replace(self, callbacks=tuple(callbacks))

    def describe(self) -> str:
        """The techniques in words, as the plan's ``Techniques:`` line names them."""
        descriptions = [_description(spec) for spec in self.callbacks]
        parts = [(description.order, description.words) for description in descriptions]
        parts += [(order, words) for order, words, on in (
            (_CHUNKED_LOSS, "chunked loss", self.chunked_loss),
            (_CPU_OFFLOAD, "CPU-offloaded state", self.cpu_offload),
            (_CONTEXT_PARALLEL, f"context parallel over {self.context_parallel_size} ranks",
             self.context_parallel_size > 1),
        ) if on]  # fmt: skip
        return ", ".join(words for _, words in sorted(parts, key=lambda part: part[0])) or "none"


def _technique_kinds(settings: PlanSettings) -> list[type]:
    """The technique callbacks ``settings`` can have: those :mod:`lit_memtrain.callbacks` exports, each replaced by
    the configured subclass of it, then the configured ones of the user's own."""
    exported = [getattr(lit_memtrain.callbacks, name) for name in lit_memtrain.callbacks.__all__]
    exported = [cls for cls in exported if isinstance(cls, type) and is_technique(cls)]
    configured = [cls for cls in (spec.resolve() for spec in settings.callbacks) if is_technique(cls)]
    kinds = [next((cls for cls in configured if issubclass(cls, kind)), kind) for kind in exported]
    return kinds + [cls for cls in dict.fromkeys(configured) if not issubclass(cls, tuple(exported))]


def _configured(settings: PlanSettings, kind: type) -> CallbackSpec:
    """``kind`` as the configuration gives it (the first configured callback that is one), or with its defaults."""
    spec = next((spec for spec in settings.callbacks if issubclass(spec.resolve(), kind)), None)
    return _spec(kind, spec.init_args if spec is not None else {})


def techniques_of(settings: PlanSettings) -> Techniques:
    """The techniques ``settings`` turn on."""
    techniques = Techniques(
        chunked_loss=_has_lm_head(settings) and _loss_type(settings) == "chunked",
        cpu_offload=settings.strategy.cpu_offload,
        context_parallel_size=settings.strategy.context_parallel_size,
    )
    configured = {spec.resolve() for spec in settings.callbacks}
    for kind in _technique_kinds(settings):
        if any(issubclass(cls, kind) for cls in configured):
            techniques = techniques.with_callback(_configured(settings, kind))
    return techniques


def _has_lm_head(settings: PlanSettings) -> bool:
    """Whether the planned model has an LM head, whose loss the chunked loss computes (a reward model has a score
    head instead, applied at each sequence's last token only)."""
    return settings.module_class != REWARD_MODULE


def _loss_type(settings: PlanSettings) -> str:
    """The module's ``loss_type``, or its default."""
    default = init_defaults(import_class(settings.module_class, "model.class_path"))["loss_type"]
    return settings.module.get("loss_type", default)


def with_techniques(settings: PlanSettings, techniques: Techniques) -> PlanSettings:
    """``settings`` with exactly ``techniques`` on (everything else unchanged)."""
    kept = tuple(spec for spec in settings.callbacks if not is_technique(spec.resolve()))
    module = {**settings.module, "loss_type": "chunked" if techniques.chunked_loss else "nll"}
    strategy = dataclasses.replace(
        settings.strategy, cpu_offload=techniques.cpu_offload, context_parallel_size=techniques.context_parallel_size
    )
    return settings.replace(module=module, callbacks=kept + techniques.callbacks, strategy=strategy)


_Change = Callable[[Techniques], Techniques]


def _setting(settings: PlanSettings, kind: type, init_args: dict[str, Any], unless: tuple[type, ...] = ()) -> _Change:
    """Set ``init_args`` on ``kind``, over the arguments it has, or those the configuration gives it; no change
    while a callback of ``unless`` is on."""

    def change(techniques: Techniques) -> Techniques:
        if any(techniques.callback(other) is not None for other in unless):
            return techniques
        current = techniques.callback(kind) or _configured(settings, kind)
        return techniques.with_callback(CallbackSpec(current.class_path, {**current.init_args, **init_args}))

    return change


@dataclass(frozen=True)
class _Row:
    order: int
    name: str
    change: _Change | None  # None: the strategy cannot have it (the note says what would)
    note: str = ""
    in_place_of: str | None = None
    strategy: bool = False  # the planner's own strategy rows build on the rows above less those in place of another


def comparison_rows(settings: PlanSettings) -> list[tuple[str, Techniques | None, str]]:
    """``--compare``'s rows for ``settings``: (name, techniques or None when the strategy cannot have it, note).

    Each row adds its technique to the last row above it that is simulated; a row in place of another adds to what
    that one added to. The strategy's own rows: CPU-offloaded state for a sharded strategy (FSDP2 or context
    parallel), context parallelism when the configuration splits sequences (``context_parallel_size > 1``); they
    build on the rows above them but those in place of another. The rows before them run the same strategy without
    them.
    """
    rows = _own_rows(settings)
    for kind in _technique_kinds(settings):
        for row in _description(_configured(settings, kind)).rows:
            change = _setting(settings, kind, row.init_args)
            rows.append(_Row(row.order, row.name, change, row.note, row.in_place_of))
    result: list[tuple[str, Techniques | None, str]] = []
    last = chain = Techniques()
    bases: dict[str, Techniques] = {}
    for row in sorted(rows, key=lambda row: row.order):
        if row.change is None:
            result.append((row.name, None, row.note))
            continue
        if row.in_place_of is not None and row.in_place_of not in bases:
            raise ValueError(
                f"The --compare row {row.name!r} stands in place of {row.in_place_of!r}, which is not a row above it."
            )
        base = bases[row.in_place_of] if row.in_place_of is not None else chain if row.strategy else last
        techniques = row.change(base)
        bases[row.name] = base
        result.append((row.name, techniques, row.note))
        last = techniques
        if row.in_place_of is None:
            chain = techniques
    return result


def _own_rows(settings: PlanSettings) -> list[_Row]:
    strategy = settings.strategy
    cp = strategy.context_parallel_size
    rows = [
        _Row(0, "plain", lambda techniques: techniques),
        _Row(_CHUNKED_LOSS, "+ chunked loss", lambda techniques: dataclasses.replace(techniques, chunked_loss=True))
        if _has_lm_head(settings) else _Row(_CHUNKED_LOSS, "+ chunked loss", None, "a reward model has no LM head"),
    ]
    if strategy.sharded:
        rows.append(_Row(_CPU_OFFLOAD, "+ CPU-offloaded state",
                         lambda techniques: dataclasses.replace(techniques, cpu_offload=True), strategy=True))
    else:
        rows.append(_Row(_CPU_OFFLOAD, "+ CPU-offloaded state", None,
                         "needs --trainer.strategy=lit_memtrain.strategies.FSDP2Strategy (cpu_offload: true)"))
    if cp > 1:
        rows.append(_Row(_CONTEXT_PARALLEL, "+ context parallel",
                         lambda techniques: dataclasses.replace(techniques, context_parallel_size=cp),
                         f"{cp} ranks per sequence, {strategy.context_parallel_method}", strategy=True))
    elif settings.preference:
        rows.append(_Row(_CONTEXT_PARALLEL, "+ context parallel", None,
                         f"{settings.module_class.rsplit('.', 1)[-1]} does not support context parallelism"))
    else:
        rows.append(_Row(_CONTEXT_PARALLEL, "+ context parallel", None,
                         "needs lit_memtrain.strategies.ContextParallelStrategy or --context-parallel-size"))
    return rows  # fmt: skip


def suggestions(settings: PlanSettings) -> list[tuple[str, Callable[[Techniques], Techniques]]]:
    """What a plan that does not fit tries, in this order, each on top of the previous ones: (how to add it, the
    change). The technique callbacks' suggestions, the chunked loss, and CPU-offloaded state for a sharded strategy."""
    found = [(_SUGGESTED_CHUNKED_LOSS, "the chunked loss (model.loss_type: chunked)",
              lambda techniques: dataclasses.replace(techniques, chunked_loss=True))] if _has_lm_head(settings) else []
    if settings.strategy.sharded:
        found.append((_SUGGESTED_CPU_OFFLOAD, "CPU-offloaded state (FSDP2Strategy with init_args cpu_offload: true)",
                      lambda techniques: dataclasses.replace(techniques, cpu_offload=True)))  # fmt: skip
    for kind in _technique_kinds(settings):
        for suggestion in _description(_configured(settings, kind)).suggestions:
            change = _setting(settings, kind, suggestion.init_args, suggestion.unless)
            found.append((suggestion.order, suggestion.text, change))
    return [(text, change) for _, text, change in sorted(found, key=lambda item: item[0])]
