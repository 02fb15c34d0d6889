"""A model's step simulated with a few of its decoder layers, and extrapolated to all of them.

Why: the decoder layers of a model are identical, and a simulation spends most of its time running them one after
another (Qwen3-8B: 36 layers, each through forward, a checkpointed recomputation and backward). What a step holds at
any moment is what the parts before and after the layers hold, plus what grows with the number of layers (their
parameters, gradients and optimizer state, the inputs the layers before this one saved, the gradients the layers
after it produced), plus what the layer running holds. So the step of a model with ``N`` identical layers is known
exactly from two simulations of the same model with fewer layers.

How, exactly: the tracker cuts a step into segments, one per phase (:class:`~lit_memtrain.planner.tracker.Segment`:
the forward of decoder layer 3, the backward of the embeddings, the optimizer step...), each with the most bytes
alive during it, by device and kind. With ``a`` anchored layers at each end (:class:`Reduction`), a model of ``n``
layers runs: the parts before the layers, the first ``a`` layers (each its own segment, anchored to the start), the
``n - 2a`` *interior* layers, the last ``a`` (anchored to the end), the parts after, and back. The same segments, in
the same order, appear at every ``n``: only the interior runs grow. For identical layers every figure of a segment
(its most bytes alive, each kind at that moment) is affine in ``n`` for a non-interior segment, and affine in ``n``
and the layer's index ``k`` for an interior one, since every other layer adds the same bytes to it: its state, and
what it saved or produced if it ran before (or after) this one. The two simulations have ``2a + 1`` and ``2a + 2``
layers: the first gives one interior layer, the second two, which fixes each interior segment's line in ``n`` and
``k``. At ``N`` layers an interior run's largest segment is its first or its last one (affine in ``k``); the peak is
the largest segment of all, the first one in time among equals, as the tracker would find it. Its phase names its
layer in the ``N``-layer model (``backward, decoder layer 34`` of 36).

What must hold, and is checked, or the model is simulated whole (and the plan's notes say why):

- the layers are identical: the same module classes, parameter shapes, dtypes and trainability, buffers, and the
  same attributes but their index (a sliding-window layer, a dense layer among mixture-of-experts ones, a Mamba
  layer among attention ones all differ), checked on the whole model as the step builds it (LoRA applied) on the
  meta device; the config's per-layer lists (``layer_types``...) hold one value; ``mlp_only_layers``,
  ``first_k_dense_replace`` and ``decoder_sparse_step`` leave every layer alike;
- the smaller models are the same model with fewer layers: their layers are the whole model's, and everything
  outside the layers is the same;
- every technique is one the planner knows to treat every layer alike (checkpointing, tiled MLP, chunked RMSNorm,
  activation offloading), and after it is applied the layers are still alike (the same wrappers and hooks);
- the layers near the ends are anchored far enough: a technique that treats the last few tensors apart
  (activation offloading keeps its ``max_fwd_stash_size`` most recent tensors on the device, and under
  checkpointing that is as many layers) anchors that many layers at each end; FSDP2 (which gathers the next
  layer in backward and keeps the root gathered) and context parallelism (per-layer exchange buffers) need one;
- both smaller simulations have the same segments in the same order, their interior runs of the expected lengths.

A model with no more layers than the two simulations together is simulated whole.
"""

from __future__ import annotations

import copy
import functools
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from transformers import PretrainedConfig

from lit_memtrain.models.layers import find_decoder_layers
from lit_memtrain.planner.simulate import MemoryReport, stand_in_device
from lit_memtrain.planner.tracker import Segment

__all__ = [
    "Reduction",
    "applied_layers_differ",
    "extrapolate",
    "layers_differ",
    "reduced_model_differs",
    "technique_anchoring",
    "with_layer_count",
]

# Attributes that hold a layer's own index (and so differ between identical layers).
_INDEX_ATTRIBUTES = frozenset({"layer_idx", "layer_id", "layer_index", "layer_number", "block_idx", "idx"})
# Config fields that make some layers different (a dense MLP among experts) whatever their module structure says.
_LAYER_CHOICES = {
    "mlp_only_layers": lambda value: not value,
    "first_k_dense_replace": lambda value: not value,
    "decoder_sparse_step": lambda value: value in (None, 0, 1),
}
_LAYER_PHASE = re.compile(r"decoder layer (\d+)")
_MODULE_PATH_INDEX = re.compile(r"(?<=\.)\d+(?=\.|$)")
_DEPTH = 3  # how deep the attributes of a layer's plain objects are compared


@dataclass(frozen=True)
class Reduction:
    """A model of ``layers`` decoder layers simulated with :attr:`counts` layers, ``anchored`` of them at each end.

    See the module docstring: the first and last ``anchored`` layers are matched between the two simulations and
    the model by their place from the start or from the end, the layers between them (one, then two) are the
    interior.
    """

    layers: int
    anchored: int = 1

    @property
    def counts(self) -> tuple[int, int]:
        return 2 * self.anchored + 1, 2 * self.anchored + 2

    @property
    def worthwhile(self) -> bool:
        """Whether the two smaller models together have fewer layers than the model (else simulate it whole)."""
        return sum(self.counts) < self.layers


def technique_anchoring(callbacks: Sequence[Any]) -> int | str:
    """How many layers at each end the step's techniques treat apart (at least one: the first and the last layer
    always differ from the others), or why the planner cannot tell.

    ``callbacks`` are the technique callbacks of the step. Only the planner's own techniques are known to treat every
    layer alike: a subclass or another callback may do anything with the layers.
    """
    from lit_memtrain.callbacks import ActivationOffloading, ChunkedRMSNorm, GradientCheckpointing, TiledMLP

    anchored = 1
    for callback in callbacks:
        kind = type(callback)
        if kind is ActivationOffloading:
            # Its most recent tensors stay on the device; under checkpointing a layer saves one, so as many layers.
            anchored = max(anchored, callback.max_fwd_stash_size)
        elif kind not in (GradientCheckpointing, TiledMLP, ChunkedRMSNorm):
            return (
                f"the technique callback {kind.__qualname__} is not one the planner knows to treat every decoder "
                "layer alike"
            )
    return anchored


def layers_differ(model: nn.Module) -> str | None:
    """Why the decoder layers of ``model`` (a causal LM as the step builds it, on the meta device) cannot be shown
    identical, or None when they are."""
    try:
        layers = find_decoder_layers(model)
    except ValueError as error:
        return str(error)
    config = getattr(model, "config", None)
    if not isinstance(config, PretrainedConfig):
        return f"{type(model).__name__} has no transformers config"
    text_config = config.get_text_config()
    if text_config.num_hidden_layers != len(layers):
        return (
            f"the config has num_hidden_layers={text_config.num_hidden_layers} but the model "
            f"{len(layers)} decoder layers"
        )
    for name, alike in _LAYER_CHOICES.items():
        value = getattr(text_config, name, None)
        if not alike(value):
            return f"the config's {name}={value!r} makes some layers different"
    for name, value in _per_layer_values(text_config, len(layers)).items():
        if len(set(map(repr, value))) > 1:
            return f"the config's {name} differs between layers ({_summary(value)})"
    first = _signature(layers[0])
    for index, layer in enumerate(layers):
        if _signature(layer) != first:
            return f"decoder layer {index} differs from decoder layer 0 ({_first_difference(layers[0], layer)})"
    return None


def with_layer_count(config: PretrainedConfig, layers: int) -> PretrainedConfig:
    """A copy of ``config`` with ``layers`` decoder layers (its per-layer lists cut to them)."""
    config = copy.deepcopy(config)
    text_config = config.get_text_config()
    for name, value in _per_layer_values(text_config, text_config.num_hidden_layers).items():
        setattr(text_config, name, type(value)(value[:layers]))
    text_config.num_hidden_layers = layers
    return config


def reduced_model_differs(whole: nn.Module, reduced: nn.Module) -> str | None:
    """Why ``reduced`` (built by :func:`with_layer_count`) is not ``whole`` with fewer layers, or None."""
    whole_layers, reduced_layers = find_decoder_layers(whole), find_decoder_layers(reduced)
    expected = _signature(whole_layers[0])
    if any(_signature(layer) != expected for layer in reduced_layers):
        return "the model built with fewer layers has other layers"
    if _signature(whole, skip=whole_layers) != _signature(reduced, skip=reduced_layers):
        return "the model built with fewer layers differs outside its layers"
    return None


def applied_layers_differ(model: nn.Module) -> str | None:
    """Why the decoder layers are no longer alike once the techniques and the strategy are applied (a wrapper or a
    hook on some layers only), or None."""
    layers = find_decoder_layers(model)
    first = _applied(layers[0])
    for index, layer in enumerate(layers):
        if _applied(layer) != first:
            return f"the techniques or the strategy treat decoder layer {index} unlike decoder layer 0"
    return None


def extrapolate(
    simulations: Sequence[tuple[MemoryReport, Sequence[Segment]]], reduction: Reduction
) -> MemoryReport | str:
    """The memory of the ``reduction.layers``-layer step from its two smaller simulations (``reduction.counts``
    layers: each its report and its segments, as :func:`~lit_memtrain.planner.simulate.measure_segments` gives
    them), or why their segments do not match (see the module docstring)."""
    counts, anchored = reduction.counts, reduction.anchored
    reports = [report for report, _ in simulations]
    timelines = []
    for (report, segments), count in zip(simulations, counts):
        timeline = _timeline(segments, count, anchored)
        if isinstance(timeline, str):
            return f"the simulation with {count} layers {timeline}"
        timelines.append(timeline)
    first, second = timelines
    if [part.label for part in first] != [part.label for part in second]:
        return f"the simulations with {counts[0]} and {counts[1]} layers run different phases"
    for report, timeline in zip(reports, timelines):
        for device, peak in ((stand_in_device(), report.device_peak), (torch.device("cpu"), report.host_peak)):
            if max((part.peak(device) for part in timeline), default=0) != peak:
                return "a simulation's segments do not account for its peak"
    layers = reduction.layers
    try:
        candidates = [point for parts in zip(first, second) for point in _points(*parts, counts, layers, anchored)]
    except _Mismatch as error:
        return str(error)
    device, host = (_largest(candidates, where) for where in (stand_in_device(), torch.device("cpu")))
    fixed = reports[0].fixed + (reports[1].fixed - reports[0].fixed) * (layers - counts[0])
    return MemoryReport(
        device_peak=device.total,
        host_peak=host.total,
        device_at_peak=device.kinds,
        fixed=fixed,
        phase=device.phase,
        host_at_peak=host.kinds,
    )


@dataclass
class _Part:
    """A segment of a simulation, or a run of interior layers' segments, matched between the two simulations."""

    label: tuple[Any, ...]
    segments: list[Segment]
    layers: list[int] = field(default_factory=list)

    def peak(self, device: torch.device) -> int:
        return max((segment.peak.get(device, 0) for segment in self.segments), default=0)


@dataclass(frozen=True)
class _Point:
    """A moment of the ``N``-layer step: bytes alive on ``device``, by kind, and the phase."""

    phase: str
    kinds: dict[str, int]
    device: torch.device

    @property
    def total(self) -> int:
        return sum(self.kinds.values())


def _timeline(segments: Sequence[Segment], layers: int, anchored: int) -> list[_Part] | str:
    parts: list[_Part] = []
    for segment in segments:
        match = _LAYER_PHASE.fullmatch(segment.where)
        stage = (segment.optimizer, segment.backward)
        if match is None:
            parts.append(_Part((*stage, segment.where), [segment]))
            continue
        index = int(match.group(1))
        if index < anchored:
            parts.append(_Part((*stage, "start", index), [segment], [index]))
        elif layers - 1 - index < anchored:
            parts.append(_Part((*stage, "end", layers - 1 - index), [segment], [index]))
        elif parts and parts[-1].label == (*stage, "interior"):
            parts[-1].segments.append(segment)
            parts[-1].layers.append(index)
        else:
            parts.append(_Part((*stage, "interior"), [segment], [index]))
    interior = list(range(anchored, layers - anchored))
    for part in parts:
        if part.label[-1] == "interior" and part.layers not in (interior, interior[::-1]):
            return f"runs its interior layers {part.layers} in an unexpected order"
    return parts


def _points(first: _Part, second: _Part, counts: tuple[int, int], layers: int, anchored: int) -> list[_Point]:
    """The moments of the ``layers``-layer step that ``first`` and ``second`` (the same part of the two smaller
    simulations) stand for: one, or an interior run's first and last segments in time."""
    stage = "backward" if first.label[1] else "forward"
    devices = {device for segment in (*first.segments, *second.segments) for device in segment.peak}
    if first.label[-1] != "interior":
        (a,), (b,) = first.segments, second.segments
        phase = a.phase
        if first.layers:
            index = first.layers[0] if first.label[-2] == "start" else layers - 1 - first.label[-1]
            phase = f"{stage}, decoder layer {index}"
        grown = _line(a, b, layers - counts[0])
        return [_Point(phase, grown(device), device) for device in devices]
    # Interior: first.segments holds layer `anchored` of the smaller model; second.segments two layers in time order.
    ascending = second.layers[0] < second.layers[1]
    at_anchor = second.segments[0 if ascending else 1]
    next_layer = second.segments[1 if ascending else 0]
    points = []
    for index in ((anchored, layers - 1 - anchored) if ascending else (layers - 1 - anchored, anchored)):
        for device in devices:
            kinds = _affine(
                first.segments[0].breakdown.get(device),
                at_anchor.breakdown.get(device),
                next_layer.breakdown.get(device),
                layers - counts[0],
                index - anchored,
            )
            points.append(_Point(f"{stage}, decoder layer {index}", kinds, device))
    return points


def _line(a: Segment, b: Segment, steps: int) -> Callable[[torch.device], dict[str, int]]:
    def grown(device: torch.device) -> dict[str, int]:
        start, end = a.breakdown.get(device), b.breakdown.get(device)
        if start is None or end is None:
            return {} if start is None and end is None else _inconsistent()
        return {kind: start[kind] + (end[kind] - start[kind]) * steps for kind in start}

    return grown


def _affine(
    base: dict[str, int] | None, more_layers: dict[str, int] | None, next_layer: dict[str, int] | None, steps: int,
    later: int,
) -> dict[str, int]:  # fmt: skip
    """``base`` (the interior layer of the smaller model) grown by ``steps`` more layers (``more_layers - base`` each)
    and moved ``later`` layers on (``next_layer - more_layers`` each)."""
    if base is None or more_layers is None or next_layer is None:
        return {} if base is None and more_layers is None and next_layer is None else _inconsistent()
    return {
        kind: base[kind] + (more_layers[kind] - base[kind]) * steps + (next_layer[kind] - more_layers[kind]) * later
        for kind in base
    }


class _Mismatch(ValueError):
    """A segment allocates on a device in one simulation and not in the other."""


def _inconsistent() -> dict[str, int]:
    raise _Mismatch("a segment allocates on a device in one simulation and not in the other")


def _largest(points: list[_Point], device: torch.device) -> _Point:
    """The first point in time with the most bytes on ``device`` (as the tracker keeps the first peak)."""
    best: _Point | None = None
    for point in points:
        if point.device == device and point.kinds and (best is None or point.total > best.total):
            best = point
    return best if best is not None else _Point("", {}, device)


def _per_layer_values(config: PretrainedConfig, layers: int) -> dict[str, Any]:
    """The config's fields that hold one value per decoder layer: lists as long as the layers (``layer_types``,
    ``no_rope_layers``...) and layer patterns written as strings (``hybrid_override_pattern``)."""
    return {
        name: value
        for name, value in vars(config).items()
        if not name.startswith("_")
        and (isinstance(value, (list, tuple)) or (isinstance(value, str) and "pattern" in name))
        and len(value) == layers
    }


def _summary(values: Sequence[Any]) -> str:
    distinct = list(dict.fromkeys(map(repr, values)))
    return ", ".join(distinct[:3]) + (", ..." if len(distinct) > 3 else "")


def _value(value: Any, depth: int = _DEPTH) -> Any:
    """What a module attribute contributes to a layer's signature."""
    if isinstance(value, str):
        return _MODULE_PATH_INDEX.sub("#", value)  # a module's own path ("model.layers.3.mlp", PEFT's target_name)
    if value is None or isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, (torch.dtype, torch.device)):
        return str(value)
    if isinstance(value, (list, tuple)) and value and all(isinstance(item, str) for item in value):
        # Names, compared as a set: PEFT lists every adapted module's path, as many per layer as the model has layers.
        return ("names", tuple(sorted({_value(item) for item in value})))
    if isinstance(value, (list, tuple)):
        return tuple(_value(item, depth) for item in value)
    if isinstance(value, (set, frozenset)):
        return tuple(sorted(repr(item) for item in value))
    if isinstance(value, dict):
        return tuple(sorted((str(key), _value(item, depth)) for key, item in value.items()))
    if isinstance(value, PretrainedConfig):
        return ("config",)  # the model's own, whose per-layer fields are checked apart
    if isinstance(value, Tensor):
        return ("tensor", tuple(value.shape), str(value.dtype))
    if callable(value):
        return ("callable", _callable_name(value))
    attributes = vars(value) if hasattr(value, "__dict__") and depth > 0 else {}
    return (type(value).__qualname__, _attributes(attributes, depth - 1))


def _attributes(attributes: dict[str, Any], depth: int = _DEPTH) -> tuple[Any, ...]:
    return tuple(
        (name, _value(value, depth))
        for name, value in sorted(attributes.items())
        if not name.startswith("_") and name not in _INDEX_ATTRIBUTES
    )


def _callable_name(value: Any) -> tuple[str, ...]:
    """A callable by its qualified name and those it wraps (``functools.wraps``, ``partial``)."""
    names: list[str] = []
    while value is not None and len(names) < 16:
        if isinstance(value, functools.partial):
            names.append("partial")
            value = value.func
            continue
        names.append(getattr(value, "__qualname__", type(value).__qualname__))
        value = getattr(value, "__wrapped__", None)
    return tuple(names)


def _modules(module: nn.Module, skip: Sequence[nn.Module] = ()) -> list[tuple[str, nn.Module]]:
    """``module``'s submodules by name, without those of ``skip`` and what they hold."""
    skipped = {id(layer) for layer in skip}
    prefixes = [name for name, sub in module.named_modules(remove_duplicate=False) if id(sub) in skipped]
    return [
        (name, sub)
        for name, sub in module.named_modules(remove_duplicate=False)
        if not any(name == prefix or name.startswith(prefix + ".") for prefix in prefixes)
    ]


def _signature(module: nn.Module, skip: Sequence[nn.Module] = ()) -> tuple[Any, ...]:
    """What makes two layers the same layer: per submodule, its class, attributes, parameters and buffers."""
    return tuple(_entry(name, sub) for name, sub in _modules(module, skip))


def _entry(name: str, module: nn.Module) -> tuple[Any, ...]:
    parameters = tuple(
        (key, tuple(param.shape), str(param.dtype), param.requires_grad)
        for key, param in module._parameters.items()
        if param is not None
    )
    buffers = tuple(
        (key, tuple(buffer.shape), str(buffer.dtype), key in module._non_persistent_buffers_set)
        for key, buffer in module._buffers.items()
        if buffer is not None
    )
    kind = f"{type(module).__module__}.{type(module).__qualname__}"
    return name, kind, _attributes(vars(module)), parameters, buffers


def _first_difference(first: nn.Module, other: nn.Module) -> str:
    """Where two layers' signatures differ, in words."""
    left, right = _signature(first), _signature(other)
    for a, b in zip(left, right):
        if a == b:
            continue
        where = a[0] or "the layer itself"
        if a[0] != b[0] or a[1] != b[1]:
            short = [name.rsplit(".", 1)[-1] for name in (a[1], b[1])]
            # Two classes of one short name (torch's Linear and peft's LoRA Linear) are told apart by their modules.
            left_class, right_class = (a[1], b[1]) if short[0] == short[1] else short
            return f"{where} is a {left_class}, {b[0] or 'the layer itself'} a {right_class}"
        if a[2] != b[2]:
            names = sorted({name for name, _ in set(a[2]) ^ set(b[2])})
            return f"{where} has other {', '.join(names)}"
        return f"{where} has other {'parameters' if a[3] != b[3] else 'buffers'}"
    return f"{len(left)} and {len(right)} submodules"


def _applied(layer: nn.Module) -> tuple[Any, ...]:
    """A layer as the techniques and the strategy left it: per submodule, its class, the ``forward`` set on the
    instance (a checkpoint, a tiled MLP...) and the hooks registered on it."""
    entries = []
    for name, module in layer.named_modules(remove_duplicate=False):
        hooks = tuple(
            _callable_name(hook)
            for hooks in (module._forward_pre_hooks, module._forward_hooks, module._backward_pre_hooks,
                          module._backward_hooks)
            for hook in hooks.values()
        )  # fmt: skip
        forward = vars(module).get("forward")
        entries.append((name, type(module), None if forward is None else _callable_name(forward), hooks))
    return tuple(entries)
