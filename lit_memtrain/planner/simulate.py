"""Peak memory of one training step, simulated on the CPU without allocating it.

Why: the memory techniques are chosen by how much they save at sequence lengths that do not fit on the
machine at hand (Qwen3-4B at 256k tokens needs hundreds of GB without them). ``FakeTensorMode`` runs the
real model code on tensors that have shapes, dtypes and devices but no storage, and
:class:`~lit_memtrain.planner.tracker.MemoryTracker` records the bytes alive on each device, by kind, at every
operation, with the phase of the step (forward or backward of which decoder layer, loss, optimizer step).
What runs is the real code path: the Hugging Face model, the techniques applied by the same functions the
callbacks use (:func:`~lit_memtrain.techniques.checkpointing.apply_checkpointing`,
:func:`~lit_memtrain.techniques.tiled_mlp.apply_tiled_mlp`), the losses of :mod:`lit_memtrain.techniques.loss`, autograd and AdamW.
:mod:`lit_memtrain.planner.step` runs a whole ``fit`` step the same way, through ``CausalLMModule``.

How, and what it assumes:
- The device is a stand-in accelerator ``gpu`` (PyTorch's Python-backed PrivateUse1 backend), so that
  host memory (``cpu``, where offloaded checkpoints go) is tracked apart from device memory. Fake CUDA
  tensors cannot run autograd on a CPU-only build. Registering it makes torch report an accelerator for the
  rest of the process, and it must precede the process's first backward: simulate in a process of its own.
- Attention runs through ``aten._scaled_dot_product_flash_attention_for_cpu``, a flash-style kernel whose
  memory is O(L) (output and an fp32 log-sum-exp per head and token), as flash-attn or SDPA's flash kernel
  on a GPU. On the stand-in device SDPA would take its math path and build L x L attention weights:
  1,540 GiB at 64k tokens where a real step needs a few.
- Every target is trainable (the worst case): data-dependent selections such as ``nonzero`` select every
  element, since fake tensors have no values.
- Autocast (``bf16-mixed``) follows CUDA's policy on the stand-in device (:mod:`lit_memtrain.planner.autocast`).
- Operators that have their own kernel on CUDA but a composite fallback elsewhere (``silu_backward``: one
  fused kernel on CUDA, five element-wise ops with their intermediates in the fallback) are given a kernel
  on the stand-in device too, so they run as one operator, as on CUDA, instead of as their fallback's steps
  (that fallback adds three ``L x I`` bf16 tensors to each MLP backward: 5 GiB for Qwen3-4B at 96k tokens).
- A tiled MLP's tiles from the second on repeat the second exactly: the same sizes, and the same state carried
  in from the tile before (the first tile's gradients become the sums, every later one adds into them; each tile
  frees what it made before the next). So only the first two tiles and the last (possibly shorter) are simulated:
  the peak is exactly that of all tiles, at a small fraction of the operations (a 36-layer model at 1M tokens runs
  ~9,000 tiles otherwise, most of a simulation's time). The chunks of the chunked RMSNorm
  (:mod:`lit_memtrain.techniques.rms_norm`) and of the chunked loss repeat the first: their outputs and gradients
  exist before the first chunk, and each chunk frees its temporaries before the next; so the first and the last
  are simulated.
- Params, gradients and AdamW state are all in ``dtype`` (bf16 by default, as Lightning's
  ``precision="bf16-true"``); the optimizer state exists before the step, as in every step after the
  first. AdamW runs with ``foreach=True`` (PyTorch's default on CUDA).
- Allocations only, at their exact sizes: no kernel workspaces, no allocator rounding or fragmentation.
  Confirm on a GPU when one is available.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import functools
import time
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor
from torch._guards import active_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.modeling_utils import AttentionInterface

from lit_memtrain.models.layers import find_decoder_layers
from lit_memtrain.models.presets import build_config
from lit_memtrain.planner.autocast import register_stand_in_autocast
from lit_memtrain.planner.tracker import MemoryTracker, Segment
from lit_memtrain.techniques.checkpointing import apply_checkpointing
from lit_memtrain.techniques.loss import chunked_cross_entropy, cross_entropy, selected_loss_chunks
from lit_memtrain.techniques.rms_norm import probe_rms_norm, probed_with, selected_chunks
from lit_memtrain.techniques.tiled_mlp import apply_tiled_mlp, selected_tiles

__all__ = [
    "MemoryReport",
    "norm_probes_on_real_tensors",
    "fake_causal_lm",
    "fixed_bytes",
    "key_value_heads_repeated",
    "measure_peak",
    "measure_segments",
    "meta_causal_lm",
    "simulate_step",
    "stand_in_device",
    "stand_in_device_registered",
    "step_phases",
    "tiles_simulated_once",
]

STAND_IN_DEVICE = "gpu"
SIMULATED_ATTENTION = "lit_memtrain_simulated"
Checkpointing = Literal["full", "selective", "offload"]
_CHECKPOINTING_MODES = ("full", "selective", "offload")
_LOSSES = ("plain", "chunked")


@dataclass(frozen=True)
class MemoryReport:
    """Simulated memory of a step, in bytes.

    Attributes:
        device_peak: the most bytes alive on the accelerator at any moment.
        host_peak: the same for host memory (offloaded checkpoints and activations).
        device_at_peak: the device bytes alive at that moment, by kind (``parameters``, ``gradients``,
            ``optimizer_state``, ``activations``, ``temporaries``, ``buffers``, ``other`` = inputs).
            Activations are what forward allocates, temporaries what backward allocates (including the
            recomputation of a checkpointed layer); the total is exact.
        fixed: the tracked modules' parameters, one gradient per trainable parameter, and the tracked
            optimizers' state, on the device: what a training step holds whatever the sequence length.
        phase: when the device peak happens (``"backward, decoder layer 0"``, ``"optimizer step"``...).
        host_at_peak: the host bytes alive at the host's own peak, by kind.
    """

    device_peak: int
    host_peak: int
    device_at_peak: dict[str, int]
    fixed: int
    phase: str = ""
    host_at_peak: dict[str, int] = field(default_factory=dict)

    @property
    def device_peak_gib(self) -> float:
        return self.device_peak / 2**30

    @property
    def host_peak_gib(self) -> float:
        return self.host_peak / 2**30


class _StandInDeviceModule(torch.utils.backend_registration._DummyBackendModule):
    """``torch.gpu``: what autocast and checkpointing ask of a device module."""

    def get_amp_supported_dtype(self) -> list[torch.dtype]:
        return [torch.float16, torch.bfloat16]


@functools.cache
def stand_in_device() -> torch.device:
    """Register the stand-in accelerator ``gpu`` once per process and return ``gpu:0``.

    From then on torch reports an accelerator named ``gpu`` in this process, and autograd can only run on
    it if it was registered before the process's first backward: simulate in a process of its own.

    Raises:
        RuntimeError: the PrivateUse1 backend is already taken by another name, or autograd already ran in
            this process before the registration.
    """
    name = torch._C._get_privateuse1_backend_name()
    if name == "privateuseone":
        torch.utils.backend_registration._setup_privateuseone_for_python_backend(
            STAND_IN_DEVICE, backend_module=_StandInDeviceModule()
        )
    elif name != STAND_IN_DEVICE:
        raise RuntimeError(
            f"Cannot simulate memory: the PrivateUse1 device is already registered as {name!r} in this process, "
            f"and the simulation needs it as its stand-in device {STAND_IN_DEVICE!r}. Run it in another process."
        )
    register_stand_in_autocast(STAND_IN_DEVICE)
    _register_fused_kernels()
    device = torch.device(STAND_IN_DEVICE, 0)
    # The device's autograd thread drops each backward's graph just after waking the caller, and the graph
    # holds Python objects (dispatch modes, callbacks): if the interpreter is already shutting down, taking
    # the GIL for that aborts the process. A pause at exit lets the thread finish first.
    atexit.register(time.sleep, 0.2)
    try:
        with FakeTensorMode():
            torch.empty(1, device=device, requires_grad=True).sum().backward()
    except RuntimeError as error:
        raise RuntimeError(
            "Cannot simulate memory in this process: autograd ran here before the simulation's stand-in device "
            "was registered, and autograd sizes its device queues once. Simulate in a fresh process (or call "
            "lit_memtrain.planner.simulate.stand_in_device() before any backward)."
        ) from error
    return device


def stand_in_device_registered() -> bool:
    """Whether :func:`stand_in_device` ran in this process (a child forked from it cannot run autograd on it)."""
    return torch._C._get_privateuse1_backend_name() == STAND_IN_DEVICE


_LIBRARIES: list[torch.library.Library] = []


def _register_fused_kernels() -> None:
    """Keep operators whole on the stand-in device where CUDA has a kernel and other devices a composite.

    The CPU kernels stand for CUDA's (a CPU-only build registers no CUDA kernels). The kernel registered here
    is never run: fake tensors are handled by ``FakeTensorMode`` before the device's kernel is reached; its
    presence only stops the dispatcher from choosing the composite fallback.
    """

    def fake_tensors_only(*args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(f"The simulation's {STAND_IN_DEVICE!r} device runs fake tensors only.")

    library = torch.library.Library("aten", "IMPL")
    for name in torch._C._dispatch_get_all_op_names():
        if name.startswith("aten::") and all(
            torch._C._dispatch_has_kernel_for_dispatch_key(name, key) for key in ("CPU", "CompositeImplicitAutograd")
        ):
            library.impl(name.removeprefix("aten::"), fake_tensors_only, "PrivateUse1")
    _LIBRARIES.append(library)


# Whether the simulated attention repeats grouped key/value heads first (see key_value_heads_repeated).
_repeat_key_value_heads = False


@contextlib.contextmanager
def key_value_heads_repeated(repeat: bool) -> Iterator[None]:
    """Simulate attention with a grouped-query model's key and value heads repeated to the query's count before
    the kernel, when ``repeat``: what ``varlen_by_document`` does under a torch whose ``varlen_attn`` takes no
    grouped heads (:func:`~lit_memtrain.techniques.attention.varlen_repeats_key_value_heads`). Each layer then
    keeps the repeated key and value for its backward, not the grouped ones."""
    global _repeat_key_value_heads
    previous, _repeat_key_value_heads = _repeat_key_value_heads, repeat
    try:
        yield
    finally:
        _repeat_key_value_heads = previous


def _flash_attention(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """Causal attention through the O(L) CPU flash kernel; GQA heads are handled by the kernel, or repeated first
    inside :func:`key_value_heads_repeated`."""
    if attention_mask is not None:
        raise ValueError("The simulated attention supports causal attention without an attention mask only.")
    if _repeat_key_value_heads and key.shape[1] != query.shape[1]:
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    output = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, dropout, True, scale=scaling)
    return output[0].transpose(1, 2), None


def fake_causal_lm(
    config: PretrainedConfig | str,
    dtype: torch.dtype = torch.bfloat16,
    prepare: Callable[[PreTrainedModel], torch.nn.Module] | None = None,
    model_class: type = AutoModelForCausalLM,
) -> torch.nn.Module:
    """A causal LM (or another ``model_class``, such as a reward model's sequence classifier) on the stand-in device
    with fake (storage-less) weights, in training mode.

    Call inside ``FakeTensorMode(allow_non_fake_inputs=True)``. Attention uses the simulated O(L) kernel.
    ``prepare`` runs on the model while it is still on the meta device (a LoRA wrapper, a dtype conversion)
    and returns the module to place on the stand-in device.
    """
    if not isinstance(active_fake_mode(), FakeTensorMode):
        raise RuntimeError("fake_causal_lm must be called inside FakeTensorMode(allow_non_fake_inputs=True).")
    with unset_fake_temporarily():
        model = meta_causal_lm(config, dtype, prepare, model_class)
    shared = _shared_parameters(model)
    model.to_empty(device=stand_in_device())
    for names in shared:  # to_empty gives each module its own copy of a shared (tied) parameter
        parameter = model.get_parameter(names[0])
        for name in names[1:]:
            owner, _, attribute = name.rpartition(".")
            setattr(model.get_submodule(owner), attribute, parameter)
    return model.train()


def meta_causal_lm(
    config: PretrainedConfig | str,
    dtype: torch.dtype = torch.bfloat16,
    prepare: Callable[[PreTrainedModel], torch.nn.Module] | None = None,
    model_class: type = AutoModelForCausalLM,
) -> torch.nn.Module:
    """The model :func:`fake_causal_lm` places on the stand-in device, still on the meta device: built from
    ``config`` with the simulated attention, then ``prepare``d. Cheap (no storage): what the planner inspects."""
    config = build_config(config) if isinstance(config, str) else copy.deepcopy(config)
    AttentionInterface.register(SIMULATED_ATTENTION, _flash_attention)
    with torch.device("meta"):
        model = model_class.from_config(config, dtype=dtype, attn_implementation=SIMULATED_ATTENTION)
        return prepare(model) if prepare is not None else model


def _shared_parameters(model: torch.nn.Module) -> list[list[str]]:
    """Names of the parameters that are one tensor (tied input and output embeddings), grouped."""
    names_by_parameter: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        names_by_parameter.setdefault(id(parameter), []).append(name)
    return [names for names in names_by_parameter.values() if len(names) > 1]


def fixed_bytes(tracked: Iterable[object]) -> int:
    """The tracked modules' parameters, one gradient per trainable parameter and the tracked optimizers' state
    on the stand-in device (a ``DTensor``'s local shard only: this rank's part)."""
    from torch.distributed.tensor import DTensor

    device = stand_in_device()
    tensors: list[tuple[Tensor, int]] = []
    for obj in tracked:
        if isinstance(obj, torch.nn.Module):
            tensors += [(param, 2 if param.requires_grad else 1) for param in obj.parameters()]
        elif isinstance(obj, torch.optim.Optimizer):
            states = obj.state.values()
            tensors += [(value, 1) for state in states for value in state.values() if isinstance(value, Tensor)]
    tensors = [(tensor.to_local() if isinstance(tensor, DTensor) else tensor, copies) for tensor, copies in tensors]
    return sum(tensor.nbytes * copies for tensor, copies in tensors if tensor.device == device)


def measure_peak(
    fn: Callable[[], object],
    *tracked: torch.nn.Module | torch.optim.Optimizer | Tensor,
    labelled: Iterable[tuple[Tensor, str]] = (),
    model: torch.nn.Module | None = None,
) -> MemoryReport:
    """Run ``fn`` on fake tensors and return the peak memory it reaches.

    ``tracked`` are what exists before ``fn`` runs and counts towards its memory: modules (parameters),
    optimizers (state), tensors (inputs); ``labelled`` are more such tensors with their kind (for example
    ``"gradients"``). Data-dependent selections (``nonzero``) select every element.
    With ``model`` (a causal LM), the phase of the peak names the decoder layer (see :func:`step_phases`).
    """
    return measure_segments(fn, *tracked, labelled=labelled, model=model)[0]


def measure_segments(
    fn: Callable[[], object],
    *tracked: torch.nn.Module | torch.optim.Optimizer | Tensor,
    labelled: Iterable[tuple[Tensor, str]] = (),
    model: torch.nn.Module | None = None,
) -> tuple[MemoryReport, tuple[Segment, ...]]:
    """:func:`measure_peak`, and the step's phases in order, each with its most bytes alive per device (see
    :class:`~lit_memtrain.planner.tracker.Segment`): what :mod:`lit_memtrain.planner.layers` extrapolates a model
    simulated with a few of its decoder layers from."""
    tracker = MemoryTracker()
    tracker.track_external(*tracked)
    for tensor, kind in labelled:
        tracker.track_tensor(tensor, kind)
    phases = step_phases(model, tracker) if model is not None else contextlib.nullcontext()
    with phases, tracker:
        fn()
    device, host = stand_in_device(), torch.device("cpu")
    report = MemoryReport(
        device_peak=tracker.peak.get(device, 0),
        host_peak=tracker.peak.get(host, 0),
        device_at_peak=tracker.peak_breakdown.get(device, {}),
        fixed=fixed_bytes(tracked),
        phase=tracker.peak_phase.get(device, ""),
        host_at_peak=tracker.peak_breakdown.get(host, {}),
    )
    return report, tuple(tracker.segments)


@contextlib.contextmanager
def step_phases(model: torch.nn.Module, tracker: MemoryTracker) -> Iterator[None]:
    """Name where the step is in ``tracker.where``: which decoder layer runs (forward, or backward through
    it), the embeddings, or the final norm, LM head and loss. Hooks only: nothing is allocated or kept."""
    layers = find_decoder_layers(model)
    handles = []

    def entering(where: str):
        def hook(module: torch.nn.Module, args: Any) -> None:
            tracker.where = where

        return hook

    def leaving(forward_next: str, backward_where: str):
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            tracker.where = forward_next
            first = output[0] if isinstance(output, (tuple, list)) else output
            if isinstance(first, Tensor) and first.requires_grad:
                first.register_hook(lambda grad: setattr(tracker, "where", backward_where))

        return hook

    def entering_after(where: str):
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            tracker.where = where

        return hook

    embeddings = model.get_input_embeddings()
    handles.append(embeddings.register_forward_pre_hook(entering("embeddings")))
    handles.append(embeddings.register_forward_hook(leaving("embeddings", "embeddings")))
    for index, layer in enumerate(layers):
        name = f"decoder layer {index}"
        handles.append(layer.register_forward_pre_hook(entering(name)))
        handles.append(layer.register_forward_hook(leaving(name, name)))
    handles.append(layers[-1].register_forward_hook(entering_after("final norm, LM head and loss")))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def tiles_simulated_once() -> Iterator[None]:
    """Run only the first two tiles and the last of each tiled MLP, and the first chunk and the last of each chunked
    RMSNorm and chunked loss (see the module docstring for why the peak is exact). For fake tensors only: on real
    ones the other tiles' outputs would be left empty."""
    with (
        selected_tiles(_first_two_and_last),
        selected_chunks(_first_and_last),
        selected_loss_chunks(_first_and_last),
    ):
        yield


def _first_two_and_last(bounds: list[tuple[int, int]]) -> list[tuple[int, int]]:
    return bounds if len(bounds) <= 3 else [*bounds[:2], bounds[-1]]


def _first_and_last(bounds: list[tuple[int, int]]) -> list[tuple[int, int]]:
    return bounds if len(bounds) <= 2 else [bounds[0], bounds[-1]]


@contextlib.contextmanager
def norm_probes_on_real_tensors() -> Iterator[None]:
    """Run the chunked RMSNorm's probe on real CPU tensors while fake ones are being simulated: the probe
    swaps in a weight of its own and compares values, which fake tensors have none of; its verdict decides
    which norms are replaced, so the plan gets the same ones as the run."""

    def on_real_tensors(norm: torch.nn.Module, dtypes: Collection[torch.dtype] | None) -> str | None:
        with unset_fake_temporarily():
            return probe_rms_norm(norm, dtypes)

    with probed_with(on_real_tensors):
        yield


def _step_loss(model: PreTrainedModel, input_ids: Tensor, position_ids: Tensor, targets: Tensor, loss: str) -> Tensor:
    """The loss as a ``training_step`` returns it: its intermediates (logits) are gone before backward."""
    if loss == "plain":
        logits = model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits
        return cross_entropy(logits.flatten(0, 1), targets.flatten())
    hidden = model.get_decoder()(input_ids=input_ids, position_ids=position_ids, use_cache=False).last_hidden_state
    return chunked_cross_entropy(hidden.flatten(0, 1), model.get_output_embeddings().weight, targets.flatten())


def _train_step(
    model: PreTrainedModel,
    optimizer: torch.optim.Optimizer | None,
    input_ids: Tensor,
    position_ids: Tensor,
    targets: Tensor,
    loss: str,
) -> None:
    _step_loss(model, input_ids, position_ids, targets, loss).backward()
    if optimizer is not None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def _initialise_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def simulate_step(
    config: PretrainedConfig | str,
    seq_len: int,
    *,
    batch_size: int = 1,
    dtype: torch.dtype = torch.bfloat16,
    loss: Literal["plain", "chunked"] = "plain",
    checkpointing: Checkpointing | None = None,
    tiled_mlp: bool = False,
    mlp_tiles: int | None = None,
    optimizer: bool = True,
) -> MemoryReport:
    """Simulate forward, loss, backward and an AdamW step of a causal LM and return its peak memory.

    Args:
        config: a ``transformers`` config or a preset name (see :mod:`lit_memtrain.models.presets`).
        seq_len: tokens per row.
        batch_size: rows per step.
        dtype: dtype of parameters, activations, gradients and optimizer state.
        loss: ``"plain"`` (logits, then cross-entropy in fp32) or ``"chunked"`` (no full logits).
        checkpointing: ``None``, ``"full"``, ``"selective"`` (keep attention outputs) or ``"offload"``
            (full, with each layer's input in host memory).
        tiled_mlp: run each decoder layer's MLP over the sequence in tiles.
        mlp_tiles: tiles per MLP call; ``None`` uses :func:`lit_memtrain.techniques.tiled_mlp.mlp_tiles`.
        optimizer: include AdamW state and its step.

    Example:
        >>> report = simulate_step("qwen3-4b", 65536, loss="chunked", checkpointing="full")  # doctest: +SKIP
        >>> round(report.device_peak_gib, 1)  # doctest: +SKIP
    """
    if loss not in _LOSSES:
        raise ValueError(f"loss must be one of {_LOSSES}, got {loss!r}.")
    if checkpointing is not None and checkpointing not in _CHECKPOINTING_MODES:
        raise ValueError(f"checkpointing must be None or one of {_CHECKPOINTING_MODES}, got {checkpointing!r}.")
    if seq_len < 1 or batch_size < 1:
        raise ValueError(f"seq_len and batch_size must be positive, got seq_len={seq_len}, batch_size={batch_size}.")
    if mlp_tiles is not None and not tiled_mlp:
        raise ValueError(f"mlp_tiles={mlp_tiles} has no effect without tiled_mlp=True.")
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = fake_causal_lm(config, dtype)
        layers = find_decoder_layers(model)
        if checkpointing is not None:
            apply_checkpointing(layers, selective=checkpointing == "selective", offload=checkpointing == "offload")
        if tiled_mlp:
            apply_tiled_mlp(layers, mlp_tiles)
        adamw = torch.optim.AdamW(model.parameters(), foreach=True) if optimizer else None
        if adamw is not None:
            _initialise_optimizer_state(model, adamw)
        device = stand_in_device()
        input_ids = torch.zeros((batch_size, seq_len), dtype=torch.long, device=device)
        position_ids = torch.arange(seq_len, device=device).expand(batch_size, seq_len)
        targets = torch.zeros((batch_size, seq_len), dtype=torch.long, device=device)
        tracked = (model, input_ids, position_ids, targets) + ((adamw,) if adamw is not None else ())
        with tiles_simulated_once():
            return measure_peak(
                lambda: _train_step(model, adamw, input_ids, position_ids, targets, loss), *tracked, model=model
            )
