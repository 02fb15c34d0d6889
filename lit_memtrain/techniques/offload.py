"""Offloading the activations saved for backward to host memory.

Why: with gradient checkpointing each decoder layer still keeps its input (tokens x hidden) on the device
until backward; at long context these tensors add up to many GB (Qwen3-4B at 96k tokens: 0.47 GB per layer,
36 layers). ``ActivationOffloader`` installs ``saved_tensors_hooks`` that copy each tensor autograd saves
inside a decoder layer to (pinned) host memory during forward, and bring it back in backward.

Rules, each learned from a failure in torchtune or TRL:

- Only tensors saved *inside a decoder layer's forward* are offloaded (module pre/post hooks mark the span).
  The LM head and the loss run outside the layers: their tensors are needed straight back, so they stay.
- Parameters, buffers and every tensor sharing storage with them stay (Linear saves a transposed view of
  its weight; under FSDP2 the unsharded weight is re-gathered in backward anyway). Storage identity is
  refreshed at each layer's pre-hook, after FSDP2 has unsharded that layer.
- Tiny tensors (under ``min_offload_bytes``) and tensor subclasses such as DTensor stay.
- Tensors saved while backward runs (checkpoint or tiled-MLP recomputation) stay: they are used at once.
- One host copy per storage: views of one storage saved by several ops (the input of the q/k/v projections,
  saved as a fresh flattened view by each matmul; the softmax output of the math attention kernel and the
  batched view of it its matmul saves) are copied once, the whole storage, and each view is rebuilt on it
  (offset, shape, strides, dtype) when backward needs it. Copying each view apart copied such a storage
  twice and brought back two device copies. (A small view of a large storage brings the whole storage: the
  device frees it only if nothing else holds it, and then all of it.) Saved tensors are matched by storage and
  version; a weak reference to the storage keeps that match from confusing a freed storage with a new one.
- The last ``max_fwd_stash_size`` tensors also stay on the device: backward needs them first.
- With CUDA streams the copies run on a side stream ordered by events. The compute stream is looked up
  (``torch.cuda.current_stream()``) at every use, never captured once: a stream captured at set-up is the
  wrong one as soon as FSDP2 or a user switches streams, and copies then race with compute (silent NaNs).
  In backward the next tensor needed is prefetched while the current one is in use.
- All state is dropped when the context exits, so nothing accumulates across steps; a warning is given
  once when host RAM use passes 60%.

Run both forward and backward inside the context::

    offloader = ActivationOffloader(model)
    with offloader:
        loss = model(input_ids, labels=labels, use_cache=False).loss
        loss.backward()
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from types import TracebackType
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from lit_memtrain.models.layers import find_decoder_layers

HOST_RAM_WARNING_PERCENT = 60.0

__all__ = ["ActivationOffloader", "OffloadStats"]


@dataclass
class OffloadStats:
    """What one step offloaded, per decoder layer: host copies (one per storage, however many views of it were
    saved) and their bytes, i.e. what left the device."""

    tensors_per_layer: list[int]
    bytes_per_layer: list[int]
    peak_host_bytes: int = 0

    @property
    def tensors(self) -> int:
        return sum(self.tensors_per_layer)

    @property
    def bytes(self) -> int:
        return sum(self.bytes_per_layer)


@dataclass
class _Record:
    """One offloaded storage, as bytes: its host copy, its device copy while one is held, the copy in flight."""

    host: Tensor
    device: Tensor | None
    device_of_origin: torch.device
    pending_unpacks: int = 1
    copy_done: torch.cuda.Event | None = None


class _Packed(NamedTuple):
    """What the pack hook gives autograd for an offloaded tensor: its storage's record and its place in it."""

    key: int
    dtype: torch.dtype
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]


def _storage_bytes(tensor: Tensor) -> Tensor:
    """The whole storage of ``tensor`` as a flat uint8 tensor (no copy; ``set_`` would keep fake storages alive)."""
    whole = tensor.detach().as_strided((tensor.untyped_storage().nbytes() // tensor.element_size(),), (1,), 0)
    return whole.view(torch.uint8)


def _view_on(storage_bytes: Tensor, packed: _Packed) -> Tensor:
    """The saved tensor ``packed`` describes, rebuilt on the storage ``storage_bytes`` covers (no copy)."""
    return storage_bytes.view(packed.dtype).as_strided(packed.shape, packed.stride, packed.offset)


def _host_ram_percent() -> float:
    import psutil

    return psutil.virtual_memory().percent


class ActivationOffloader:
    """Context manager moving activations saved inside decoder layers to host memory and back.

    Args:
        model: a module holding the decoder layers (a LightningModule, a Hugging Face model, a PEFT model).
        layers_path: dotted path to the layer ``nn.ModuleList`` when it cannot be found automatically.
        min_offload_bytes: tensors smaller than this stay on the device.
        max_fwd_stash_size: how many of the most recently saved tensors stay on the device as well.
        use_streams: copy on a side CUDA stream (overlapping compute); ``False`` copies synchronously.
        offload_cpu_tensors_for_testing: treat CPU tensors as offloadable (host copies are CPU clones), so the
            whole path runs in CPU tests. Never useful in training.

    With gradient checkpointing each layer saves one tensor (its input), so ``max_fwd_stash_size`` counts
    layers: 1 or 2 keeps the copy of the last layers off the critical path without holding much.

    Host copies are kept until the context exits (a second backward over a retained graph still finds them);
    a device copy is dropped as soon as every saved reference to it has been unpacked. ``stats`` describes the
    last (or current) step.

    Example:
        >>> offloader = ActivationOffloader(model, max_fwd_stash_size=1)  # doctest: +SKIP
        >>> with offloader:  # doctest: +SKIP
        ...     loss_fn(model(input_ids)).backward()
        >>> offloader.stats.tensors_per_layer  # doctest: +SKIP
        [1, 1, 1, 1]
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        layers_path: str | None = None,
        min_offload_bytes: int = 1024,
        max_fwd_stash_size: int = 5,
        use_streams: bool = True,
        offload_cpu_tensors_for_testing: bool = False,
    ) -> None:
        if min_offload_bytes < 0:
            raise ValueError(f"min_offload_bytes must be >= 0, got {min_offload_bytes}.")
        if max_fwd_stash_size < 0:
            raise ValueError(f"max_fwd_stash_size must be >= 0, got {max_fwd_stash_size}.")
        self.layers = find_decoder_layers(model, layers_path)
        self.min_offload_bytes = min_offload_bytes
        self.max_fwd_stash_size = max_fwd_stash_size
        self.use_streams = use_streams
        self.offload_cpu_tensors_for_testing = offload_cpu_tensors_for_testing
        self.stats = OffloadStats([0] * len(self.layers), [0] * len(self.layers))
        self._records: dict[int, _Record] = {}
        self._stash: list[int] = []
        self._key_of_storage: dict[int, tuple[StorageWeakRef, int, int]] = {}
        self._current_layer: int | None = None
        self._layer_storages: set[int] = set()
        self._prefetched: int | None = None
        self._host_bytes = 0
        self._copy_streams: dict[torch.device, torch.cuda.Stream] = {}
        self._hook_handles: list[Any] = []
        self._saved_tensors_hooks: torch.autograd.graph.saved_tensors_hooks | None = None
        self._warned_host_ram = False

    @property
    def active(self) -> bool:
        return self._saved_tensors_hooks is not None

    @property
    def host_bytes(self) -> int:
        """Bytes of host copies held right now (0 outside the context)."""
        return self._host_bytes

    def __enter__(self) -> ActivationOffloader:
        if self.active:
            raise RuntimeError("ActivationOffloader is already active; exit it before entering again.")
        self._reset()
        self.stats = OffloadStats([0] * len(self.layers), [0] * len(self.layers))
        for index, layer in enumerate(self.layers):
            self._hook_handles.append(layer.register_forward_pre_hook(self._make_enter_layer(index)))
            self._hook_handles.append(layer.register_forward_hook(self._leave_layer, always_call=True))
        self._saved_tensors_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._saved_tensors_hooks.__enter__()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if not self.active:
            return
        self._saved_tensors_hooks.__exit__(exc_type, exc, traceback)
        self._saved_tensors_hooks = None
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles.clear()
        self._warn_if_host_ram_high()
        self._reset()

    def _reset(self) -> None:
        for record in self._records.values():
            self._settle(record)
        self._records.clear()
        self._stash.clear()
        self._key_of_storage.clear()
        self._current_layer = None
        self._layer_storages = set()
        self._prefetched = None
        self._host_bytes = 0

    def _warn_if_host_ram_high(self) -> None:
        if self._warned_host_ram or self.stats.tensors == 0:
            return
        percent = _host_ram_percent()
        if percent > HOST_RAM_WARNING_PERCENT:
            self._warned_host_ram = True
            warnings.warn(
                f"Host RAM is {percent:.0f}% used while offloading activations "
                f"({self.stats.peak_host_bytes / 2**30:.2f} GiB offloaded at peak). Close to the limit the "
                "machine swaps or the process is killed: lower the sequence length, offload less "
                "(raise min_offload_bytes) or add host memory.",
                stacklevel=2,
            )

    def _make_enter_layer(self, index: int):
        def enter_layer(module: nn.Module, args: Any) -> None:
            self._current_layer = index
            self._layer_storages = {
                tensor.untyped_storage()._cdata
                for tensor in (*module.parameters(), *module.buffers())
                if not is_traceable_wrapper_subclass(tensor)
            }

        return enter_layer

    def _leave_layer(self, module: nn.Module, args: Any, output: Any) -> None:
        self._current_layer = None

    def _should_offload(self, tensor: Tensor) -> bool:
        if self._current_layer is None or torch._C._current_graph_task_id() != -1:
            return False
        if tensor.device.type == "cpu" and not self.offload_cpu_tensors_for_testing:
            return False
        if tensor.layout != torch.strided or is_traceable_wrapper_subclass(tensor):
            return False
        if tensor.is_conj() or tensor.is_neg():  # a view rebuilt on the storage would lose the lazy bit
            return False
        if tensor.untyped_storage().nbytes() % tensor.element_size():  # not one dtype's storage: not rebuilt
            return False
        if tensor.numel() * tensor.element_size() < self.min_offload_bytes:
            return False
        return tensor.untyped_storage()._cdata not in self._layer_storages

    def _pack(self, tensor: Tensor) -> Any:
        if not self._should_offload(tensor):
            return tensor
        storage = tensor.untyped_storage()
        packed = _Packed(
            len(self._records), tensor.dtype, tensor.storage_offset(), tuple(tensor.shape), tensor.stride()
        )
        known = self._key_of_storage.get(storage._cdata)
        if known is not None and not known[0].expired() and known[1] == tensor._version:
            self._records[known[2]].pending_unpacks += 1
            return packed._replace(key=known[2])
        device_bytes = _storage_bytes(tensor)
        host = torch.empty_like(device_bytes, device="cpu", pin_memory=tensor.is_cuda)
        record = _Record(host=host, device=device_bytes, device_of_origin=tensor.device)
        if self._uses_streams(tensor.device):
            compute = torch.cuda.current_stream(tensor.device)
            copy = self._copy_stream(tensor.device)
            copy.wait_stream(compute)
            with torch.cuda.stream(copy):
                host.copy_(device_bytes, non_blocking=True)
                record.copy_done = copy.record_event()
        else:
            host.copy_(device_bytes)
        self._records[packed.key] = record
        self._key_of_storage[storage._cdata] = (StorageWeakRef(storage), tensor._version, packed.key)
        nbytes = host.numel()
        self._host_bytes += nbytes
        self.stats.peak_host_bytes = max(self.stats.peak_host_bytes, self._host_bytes)
        self.stats.tensors_per_layer[self._current_layer] += 1
        self.stats.bytes_per_layer[self._current_layer] += nbytes
        self._stash.append(packed.key)
        while len(self._stash) > self.max_fwd_stash_size:
            evicted = self._records[self._stash.pop(0)]
            self._settle(evicted)
            evicted.device = None
        return packed

    def _unpack(self, packed: Any) -> Tensor:
        if isinstance(packed, Tensor):
            return packed
        record = self._records.get(packed.key)
        if record is None:
            raise RuntimeError(
                "An offloaded activation was already released: backward ran after the ActivationOffloader "
                "context exited. Run forward and backward inside the same context."
            )
        if record.device is None:
            self._bring_back(record)
        self._settle(record)
        tensor = _view_on(record.device, packed)
        record.pending_unpacks -= 1
        if record.pending_unpacks <= 0:
            record.device = None
            if packed.key in self._stash:
                self._stash.remove(packed.key)
        self._prefetch_before(packed.key)
        return tensor

    def _bring_back(self, record: _Record) -> None:
        device = record.device_of_origin
        if self._uses_streams(device):
            compute = torch.cuda.current_stream(device)
            copy = self._copy_stream(device)
            record.device = torch.empty_like(record.host, device=device)
            copy.wait_stream(compute)
            with torch.cuda.stream(copy):
                record.device.copy_(record.host, non_blocking=True)
                record.copy_done = copy.record_event()
        else:
            record.device = record.host.to(device)

    def _prefetch_before(self, key: int) -> None:
        """Start bringing back the next tensor backward will need: the latest earlier one only on the host.

        One prefetch at a time, so a wrong guess costs at most one tensor of device memory.
        """
        if self._prefetched is not None and self._records[self._prefetched].device is not None:
            return
        self._prefetched = None
        for earlier in range(key - 1, -1, -1):
            record = self._records[earlier]
            if record.device is None and record.pending_unpacks > 0:
                if self._uses_streams(record.device_of_origin):
                    self._bring_back(record)
                    self._prefetched = earlier
                return

    def _settle(self, record: _Record) -> None:
        """Make the current compute stream wait for the record's copy before its device tensor is used or freed."""
        if record.copy_done is not None:
            torch.cuda.current_stream(record.device_of_origin).wait_event(record.copy_done)
            record.copy_done = None

    def _uses_streams(self, device: torch.device) -> bool:
        return self.use_streams and device.type == "cuda"

    def _copy_stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._copy_streams:
            self._copy_streams[device] = torch.cuda.Stream(device)
        return self._copy_streams[device]
