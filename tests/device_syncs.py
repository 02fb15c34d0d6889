"""Count, on a CPU, the operations of a training step that would make the host wait for a CUDA device.

Why: a step that reads a device value on the host (``.item()``, ``.tolist()``, ``bool(t)``, ``.cpu()``, ``nonzero``,
printing, a tensor in an ``if``) or copies a pageable host value to the device without ``non_blocking``
(``torch.tensor(x, device=cuda)``, ``t.to(cuda)``; PyTorch waits for the stream after such a copy) stops the host
from queueing the next kernels while the GPU drains: the GPU then idles between steps. Such reads creep back one at
a time and no CPU test sees them, since on a CPU nothing waits. :class:`DeviceSyncCounter` counts them on a CPU by
following which tensors *would* live on the accelerator.

How it tells device tensors from host ones (a ``TorchFunctionMode``, seeing every torch call made from Python):

- host: a tensor made while counting by a factory given no device or the string ``"cpu"`` (``torch.tensor(x)``,
  ``torch.from_numpy``: what collators make), by ``.cpu()`` / ``.to("cpu")`` / ``.pin_memory()``, or computed from
  host tensors only;
- device: any other tensor: made before counting began (the model's parameters, marked by :meth:`mark_device`), made
  by autograd (gradients), made by a factory given a ``torch.device`` object (code passes the training device so,
  ``self.device`` is ``cpu`` on this machine), moved by ``.to(torch.device)``, or computed from a device tensor;
  and what :meth:`mark_device` is given (the batch after Lightning's transfer, which is ``non_blocking`` on CUDA).

Counted: a read of a device tensor on the host, and a blocking copy of host data to the device. Not seen: code that
branches on ``tensor.device.type == "cpu"`` takes its CPU branch here (keep host values host whatever the device is);
reads inside C++ (the autograd engine's own work) are not Python calls; ``host.to(other.device)`` is taken to stay
where it is (on CUDA it is a blocking copy when ``other`` is on the device, and what is read of the result later is
missed too); and the batch's transfer is taken as free (non-blocking only from pinned memory, which the data loaders
here do not ask for).
"""

from __future__ import annotations

import traceback
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakTensorKeyDictionary

Tensor = torch.Tensor
_READS = {
    Tensor.item, Tensor.tolist, Tensor.numpy, Tensor.__bool__, Tensor.__int__, Tensor.__float__, Tensor.__index__,
    Tensor.__complex__, Tensor.__format__, Tensor.__repr__, Tensor.__array__, Tensor.nonzero, torch.nonzero,
    Tensor.argwhere, torch.argwhere, Tensor.masked_select, torch.masked_select, Tensor.unique, torch.unique,
    Tensor.unique_consecutive, torch.unique_consecutive, Tensor.equal, torch.equal, Tensor.allclose, torch.allclose,
    Tensor.bincount, torch.bincount,
}  # fmt: skip
_MADE_FROM_DATA = {torch.tensor, torch.as_tensor, Tensor.new_tensor}
_MOVES = {Tensor.to, Tensor.cuda}
_OWN_FILE = str(Path(__file__).resolve())


def _tensors(value: Any) -> Iterator[Tensor]:
    if isinstance(value, Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def _where() -> str:
    """The innermost frame of the code under test (not torch's, not this file's), as ``package/file.py:line fn``."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        path = str(Path(frame.filename).resolve())
        if path == _OWN_FILE or "/torch/" in path or path.endswith("/contextlib.py"):
            continue
        for anchor, shown in (("/site-packages/", ""), ("/lit_memtrain/", "lit_memtrain/"), ("/tests/", "tests/")):
            if anchor in path:
                path = shown + path.rsplit(anchor, 1)[1]
                break
        return f"{path}:{frame.lineno} {frame.name}"
    return "?"


def _device_argument(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The ``device`` a factory or ``.to`` was given: a keyword, or (``.to``) a positional string or device."""
    if "device" in kwargs:
        return kwargs["device"]
    if func in _MOVES:
        return next((value for value in args[1:] if isinstance(value, (str, torch.device))), None)
    return None


TRAINING_DEVICE = torch.device("cpu", 0)
"""The device to train on while counting: a CPU with an index, which the tensors made on it do not show
(``tensor.device`` is ``cpu``), so that ``.to(TRAINING_DEVICE)`` (a move to the accelerator) differs from
``.to(host_tensor.device)`` (staying on the host)."""


class DeviceSyncCounter(TorchFunctionMode):
    """A mode that counts host<->device synchronisations, each with where it happened, into :attr:`events`.

    Counting is on only while :attr:`window` is not ``None``; events are kept per window (a training step's index).

    Example:
        >>> counter = DeviceSyncCounter()
        >>> with counter:
        ...     counter.window = 0
        ...     loss = torch.ones(2, device=torch.device("cpu")).sum()
        ...     value = loss.item()
        >>> counter.per_window()[0]
        ['item at ...']
    """

    def __init__(self) -> None:
        super().__init__()
        self._host: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
        self.window: Any = None
        self.events: list[tuple[Any, str]] = []

    def mark_device(self, value: Any) -> None:
        """Take the tensors in ``value`` (nested lists, tuples, dicts, modules' parameters) as device tensors."""
        if isinstance(value, torch.nn.Module):
            value = [*value.parameters(), *value.buffers()]
        for tensor in _tensors(value):
            self._host.pop(tensor, None)

    def mark_host(self, value: Any) -> Any:
        """Take the tensors in ``value`` as host tensors (a collator's batch); returns ``value``."""
        for tensor in _tensors(value):
            self._host[tensor] = True
        return value

    def is_host(self, tensor: Tensor) -> bool:
        return tensor in self._host

    def per_window(self) -> dict[Any, list[str]]:
        """The events of each window, as ``"<operation> at <file:line function>"``, in order."""
        windows: dict[Any, list[str]] = {}
        for window, event in self.events:
            windows.setdefault(window, []).append(event)
        return windows

    def _count(self, operation: str) -> None:
        if self.window is not None:
            self.events.append((self.window, f"{operation} at {_where()}"))

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        inputs = list(_tensors(args)) + list(_tensors(kwargs))
        on_device = any(not self.is_host(t) for t in inputs)
        name = getattr(func, "__name__", str(func))
        device = None if func in _READS else _device_argument(func, args, kwargs)
        if func in _MOVES and isinstance(device, torch.device) and device.index is None:
            device = None  # ``.to(other.device)``: taken to stay where it is
        to_host = func is Tensor.cpu or func is Tensor.pin_memory or device == "cpu"
        to_device = isinstance(device, torch.device) or func is Tensor.cuda
        non_blocking = bool(kwargs.get("non_blocking", False))
        if func in _READS and on_device:
            self._count(name)
        elif to_host and on_device and not non_blocking:
            self._count(name)
        elif func in _MOVES and to_device and inputs and not on_device and not non_blocking:
            self._count(f"{name} (blocking copy to the device)")
        elif func in _MADE_FROM_DATA and (to_device or (func is Tensor.new_tensor and on_device)):
            if not any(not self.is_host(t) for t in inputs[1 if func is Tensor.new_tensor else 0:]):
                self._count(f"{name} (blocking copy to the device)")
        elif func is Tensor.__getitem__ and on_device:
            index = args[1] if len(args) > 1 else None
            if any(t.dtype == torch.bool and not self.is_host(t) for t in _tensors(index)):
                self._count("boolean-mask indexing")
        elif func is Tensor.copy_ and len(args) > 1 and isinstance(args[1], Tensor) and not non_blocking:
            if self.is_host(args[0]) != self.is_host(args[1]):
                self._count("copy_ between host and device")
        output = func(*args, **kwargs)
        if func in _READS or func is Tensor.copy_:
            return output
        if to_host:
            host = True
        elif to_device:
            host = False
        elif device is not None:  # a factory told "cpu" (a string) or another host device
            host = True
        else:
            host = not on_device
        for tensor in _tensors(output):
            if host:
                self._host[tensor] = True
            else:
                self._host.pop(tensor, None)
        return output


def count_per_step(counter: DeviceSyncCounter) -> Counter[Any]:
    """How many events each window has."""
    return Counter(window for window, _ in counter.events)
