"""Live bytes per device and kind while code runs on fake tensors, with the peak and where it happened.

Why our own tracker and not ``torch.distributed._tools.mem_tracker.MemTracker``: a plan simulates tens of
thousands of operations, each passing through every Python dispatch mode on the stack. MemTracker also runs
module hooks on every module call (its per-module statistics, which a plan does not use) and copies its
snapshot at every peak; measured on a chunked loss, it added about 70% to the fake-tensor cost of each
operation, this tracker about 10-30%. What a plan needs, it keeps: the bytes alive on each device by kind,
the largest total per device and the breakdown and phase at that moment.

How bytes are counted: every tensor an operation returns is looked at once per storage; a new storage adds
its ``nbytes`` to its device and kind, and a weak reference removes them when the storage is freed. Views
and in-place results share a storage and add nothing. A tensor subclass that wraps others (a ``DTensor``: its
local shard) is counted by the storages of what it wraps, not by the wrapper's own (which has the global
size). A storage resized in place (``UntypedStorage.resize_``, which no dispatch mode sees: FSDP2 frees a
gathered parameter's storage after use and re-allocates it for the next all-gather) is re-counted at its new
size while the tracker is active. A module's parameters when it is called, and its submodules' when it returns,
are ``parameters``, whatever made them: FSDP2 gathers a layer's parameters into buffers it allocates in the
step and hands them to the module for its forward (the LM head's weight, which the chunked loss reads without
calling the head, is relabelled when the root's forward returns). The kind of a new storage is given by when it is made:
``activations`` in forward, ``temporaries`` while autograd runs backward, ``optimizer_state`` during an
optimizer step; a parameter's gradient is re-labelled ``gradients`` once autograd has accumulated it, and
what existed before (parameters, buffers, optimizer state, inputs) is registered with :meth:`track_external`.
Exact sizes, no allocator rounding: this is ``torch.cuda.memory_allocated``'s view, not the reserved memory.

The step as a sequence of segments (:attr:`MemoryTracker.segments`): a new segment starts whenever the phase
changes (forward or backward, which part of the model, the optimizer step), and each keeps, per device, the most
bytes alive during it and their breakdown. The peak is the largest of them; the planner reads the rest to
extrapolate a model simulated with a few of its decoder layers to all of them (:mod:`lit_memtrain.planner.layers`).

Fake tensors have no values: a data-dependent selection (``nonzero``) selects every element here, the worst
case (every target trainable).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

__all__ = ["KINDS", "MemoryTracker", "Segment"]

_DEVICE_QUERY = torch.ops.prim.device.default

KINDS = ("parameters", "buffers", "gradients", "optimizer_state", "activations", "temporaries", "other")


@dataclass
class Segment:
    """A stretch of the step in one phase, with the most bytes alive on each device during it.

    Attributes:
        backward: autograd was running (a backward, including a checkpointed layer's recomputation).
        optimizer: an optimizer step was running.
        where: the part of the model that ran (:attr:`MemoryTracker.where`; empty during an optimizer step).
        peak: per device, the most bytes alive at an allocation on it during the segment (devices without one
            are absent).
        breakdown: per device, the bytes alive by kind at that moment.
    """

    backward: bool
    optimizer: bool
    where: str
    peak: dict[torch.device, int] = field(default_factory=dict)
    breakdown: dict[torch.device, dict[str, int]] = field(default_factory=dict)

    @property
    def phase(self) -> str:
        """As :meth:`MemoryTracker.phase` names it."""
        if self.optimizer:
            return "optimizer step"
        stage = "backward" if self.backward else "forward"
        return f"{stage}, {self.where}" if self.where else stage


class MemoryTracker(TorchDispatchMode):
    """Track the bytes alive per device and kind, and each device's peak with its breakdown and phase.

    Set :attr:`where` to say which part of the model runs (the planner's hooks name the decoder layer): the
    phase at a device's peak, kept in :attr:`peak_phase`, is ``"forward, <where>"``, ``"backward, <where>"``
    (while autograd runs) or ``"optimizer step"``.

    Example:
        >>> tracker = MemoryTracker()  # doctest: +SKIP
        >>> tracker.track_external(model, optimizer, input_ids)  # doctest: +SKIP
        >>> with tracker:  # doctest: +SKIP
        ...     loss_fn(model(input_ids)).backward()
        >>> tracker.peak[torch.device("gpu", 0)]  # doctest: +SKIP
    """

    def __init__(self) -> None:
        super().__init__()
        self.where = ""
        self.in_optimizer_step = False
        self.live: dict[torch.device, dict[str, int]] = {}
        self.peak: dict[torch.device, int] = {}
        self.peak_breakdown: dict[torch.device, dict[str, int]] = {}
        self.peak_phase: dict[torch.device, str] = {}
        self.segments: list[Segment] = []
        self._storages: dict[int, tuple[weakref.ref, torch.device, list[Any]]] = {}
        self._handles: list[Any] = []

    def track_external(self, *objects: torch.nn.Module | torch.optim.Optimizer | Tensor) -> None:
        """Count what exists before the tracked code runs: modules (parameters, buffers, gradients),
        optimizers (state), tensors (``other``: the inputs)."""
        for obj in objects:
            if isinstance(obj, torch.nn.Module):
                for param in obj.parameters():
                    self._add(param, "parameters")
                    if param.grad is not None:
                        self._add(param.grad, "gradients")
                    if param.requires_grad:
                        self._handles.append(param.register_post_accumulate_grad_hook(self._gradient_accumulated))
                for buffer in obj.buffers():
                    self._add(buffer, "buffers")
            elif isinstance(obj, torch.optim.Optimizer):
                self._add_optimizer_state(obj)
                self._handles.append(obj.register_step_pre_hook(self._optimizer_step_starts))
                self._handles.append(obj.register_step_post_hook(self._optimizer_step_ends))
            elif isinstance(obj, Tensor):
                self._add(obj, "other")
            else:
                raise TypeError(f"Cannot track a {type(obj).__name__}: give modules, optimizers or tensors.")

    def track_tensor(self, tensor: Tensor, kind: str) -> None:
        """Count an existing tensor under ``kind`` (one of :data:`KINDS`)."""
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}.")
        self._add(tensor, kind)

    def total(self, device: torch.device) -> int:
        """Bytes alive on ``device`` right now."""
        return sum(self.live.get(device, {}).values())

    def __enter__(self) -> MemoryTracker:
        original = torch.UntypedStorage.resize_

        def resize_(storage: torch.UntypedStorage, size: int) -> Any:
            result = original(storage, size)
            self._resized(storage)
            return result

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        self._restore_resize = original
        self._handles.append(torch.nn.modules.module.register_module_forward_pre_hook(self._module_called))
        self._handles.append(torch.nn.modules.module.register_module_forward_hook(self._module_ran))
        return super().__enter__()

    def __exit__(self, *args: Any) -> None:
        torch.UntypedStorage.resize_ = self._restore_resize  # type: ignore[method-assign]
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        super().__exit__(*args)

    def phase(self) -> str:
        """What runs now: ``"forward, <where>"``, ``"backward, <where>"`` or ``"optimizer step"``."""
        if self.in_optimizer_step:
            return "optimizer step"
        stage = "backward" if torch._C._current_graph_task_id() != -1 else "forward"
        return f"{stage}, {self.where}" if self.where else stage

    def _module_called(self, module: torch.nn.Module, args: Any) -> None:
        for param in module.parameters(recurse=False):
            self._add(param, "parameters")

    def _module_ran(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        """Also the parameters of submodules that were read but not called (an LM head whose weight the
        chunked loss reads), as they are at the end of the module's forward."""
        for param in module.parameters():
            self._add(param, "parameters")

    def _gradient_accumulated(self, param: Tensor) -> None:
        if param.grad is not None:
            self._add(param.grad, "gradients")

    def _optimizer_step_starts(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.in_optimizer_step = True

    def _optimizer_step_ends(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.in_optimizer_step = False
        self._add_optimizer_state(optimizer)

    def _add_optimizer_state(self, optimizer: torch.optim.Optimizer) -> None:
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, Tensor):
                    self._add(value, "optimizer_state")

    def _kind_now(self) -> str:
        if self.in_optimizer_step:
            return "optimizer_state"
        return "temporaries" if torch._C._current_graph_task_id() != -1 else "activations"

    def _add(self, tensor: Tensor, kind: str, relabel: bool = True) -> None:
        """Count ``tensor``'s storage under ``kind``; a storage already counted moves to ``kind`` if ``relabel``."""
        if is_traceable_wrapper_subclass(tensor):
            names, _ = tensor.__tensor_flatten__()
            for name in names:
                inner = getattr(tensor, name)
                if isinstance(inner, Tensor):
                    self._add(inner, kind, relabel)
            return
        storage = tensor.untyped_storage()
        key = id(storage)
        known = self._storages.get(key)
        if known is not None and known[0]() is storage:
            record = known[2]
            if relabel and record[0] != kind:
                kinds = self.live[known[1]]
                kinds[record[0]] -= record[1]
                kinds[kind] += record[1]
                record[0] = kind
            return
        nbytes = storage.nbytes()
        device = tensor.device
        record = [kind, nbytes]
        kinds = self.live.setdefault(device, dict.fromkeys(KINDS, 0))
        kinds[kind] += nbytes
        self._storages[key] = (weakref.ref(storage, self._freed(key, device, record)), device, record)
        self._update_peak(device)

    def _resized(self, storage: torch.UntypedStorage) -> None:
        """Re-count a counted storage that was resized in place."""
        known = self._storages.get(id(storage))
        if known is None or known[0]() is not storage:
            return
        _, device, record = known
        nbytes = storage.nbytes()
        if nbytes != record[1]:
            self.live[device][record[0]] += nbytes - record[1]
            record[1] = nbytes
            self._update_peak(device)

    def _update_peak(self, device: torch.device) -> None:
        kinds = self.live[device]
        total = sum(kinds.values())
        segment = self._segment()
        if total > segment.peak.get(device, -1):
            segment.peak[device] = total
            segment.breakdown[device] = dict(kinds)
            if total > self.peak.get(device, -1):
                self.peak[device] = total
                self.peak_breakdown[device] = segment.breakdown[device]
                self.peak_phase[device] = segment.phase

    def _segment(self) -> Segment:
        """The current segment, a new one if the phase changed since the last allocation."""
        optimizer = self.in_optimizer_step
        backward = not optimizer and torch._C._current_graph_task_id() != -1
        where = "" if optimizer else self.where
        if self.segments:
            last = self.segments[-1]
            if last.where == where and last.backward == backward and last.optimizer == optimizer:
                return last
        self.segments.append(Segment(backward, optimizer, where))
        return self.segments[-1]

    def _freed(self, key: int, device: torch.device, record: list[Any]):
        def on_free(_: weakref.ref) -> None:
            self.live[device][record[0]] -= record[1]
            entry = self._storages.get(key)
            if entry is not None and entry[2] is record:
                del self._storages[key]

        return on_free

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is _DEVICE_QUERY and type(args[0]) is FakeTensor:
            # C++ code asks a fake tensor its device many times an operator (half the calls of a simulated step);
            # answered here as FakeTensor answers it outside its kernels (the mode never sees those), without a
            # second trip through the dispatcher, and nothing is allocated.
            return args[0].fake_device
        if func is torch.ops.aten.nonzero.default:
            (mask,) = args
            out = torch.empty((mask.numel(), mask.dim()), dtype=torch.long, device=mask.device)
        else:
            out = func(*args, **(kwargs or {}))
        kind = None
        for tensor in _tensors(out):
            kind = kind or self._kind_now()
            self._add(tensor, kind, relabel=False)
        return out


def _tensors(out: Any) -> Iterable[Tensor]:
    if isinstance(out, Tensor):
        return (out,)
    if isinstance(out, (tuple, list)):
        return [item for item in out if isinstance(item, Tensor)]
    return ()
