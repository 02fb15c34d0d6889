"""Per-rank peak memory of a training step sharded with FSDP2, simulated on the CPU.

Why a simulation of its own: with sharding, what one GPU holds depends on the rank count and on what lives
in host memory: sharded parameters, gradients and optimizer state (a 1/N share each, or nothing on the
device with ``cpu_offload``), the layer whose parameters are gathered, the root's gathered parameters
(embeddings, LM head), the gradients waiting for their reduce-scatter. None of this is a formula worth
trusting: the step here runs torch's own ``fully_shard`` (as :class:`~lit_memtrain.strategies.FSDP2Strategy`
applies it: each decoder layer, then the root, a ``MixedPrecisionPolicy``, a ``CPUOffloadPolicy``) on fake
tensors, against a fake process group of ``world_size`` ranks in which this process is rank 0 (every rank
holds the same, up to padding). Collectives move no data; their output buffers are allocated as on a GPU.

Everything else is :mod:`lit_memtrain.planner.simulate`'s: the stand-in device ``gpu`` (given the streams
and events FSDP2 asks of a device; they do nothing), the O(L) attention, the peak tracker, the same
techniques applied by the same functions as the callbacks. Each rank trains on its own row of ``seq_len``
tokens (data parallelism: sharding does not split the sequence). As there: simulate in a process of its
own, allocations only (no workspaces, no fragmentation).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy
from transformers import PretrainedConfig

from lit_memtrain.techniques.checkpointing import apply_checkpointing
from lit_memtrain.models.layers import find_decoder_layers
from lit_memtrain.techniques.loss import chunked_cross_entropy, cross_entropy
from lit_memtrain.planner.simulate import Checkpointing, MemoryReport, fake_causal_lm, measure_peak, stand_in_device
from lit_memtrain.parallel.fsdp import parallelize, run_inside_forward
from lit_memtrain.techniques.tiled_mlp import apply_tiled_mlp

__all__ = ["fake_process_group", "simulate_sharded_step"]

_FAKE_BACKEND = "lit_memtrain_fake"


def fake_process_group(world_size: int) -> None:
    """A process group of ``world_size`` ranks on the stand-in device where this process is rank 0."""
    from torch.testing._internal.distributed.fake_pg import FakeStore, _create_fake_pg

    device = stand_in_device()
    module = getattr(torch, device.type)
    for name in ("Stream", "Event", "current_stream", "stream"):  # FSDP2 orders its copies with these
        if not hasattr(module, name):
            setattr(module, name, getattr(torch.cpu, name))
    if _FAKE_BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(_FAKE_BACKEND, _create_fake_pg, extended_api=True, devices=[device.type])
    if dist.is_initialized():
        if dist.get_world_size() == world_size and dist.get_backend() == _FAKE_BACKEND:
            return
        dist.destroy_process_group()
    dist.init_process_group(_FAKE_BACKEND, store=FakeStore(), rank=0, world_size=world_size)


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, inputs: dict[str, Tensor], targets: Tensor, loss: str) -> None:
    def forward_and_loss() -> Tensor:
        if loss == "plain":
            return cross_entropy(model(**inputs, use_cache=False).logits.flatten(0, 1), targets)
        hidden = model.get_decoder()(**inputs, use_cache=False).last_hidden_state
        return chunked_cross_entropy(hidden.flatten(0, 1), model.get_output_embeddings().weight, targets)

    run_inside_forward(model, forward_and_loss).backward()
    if optimizer is not None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def simulate_sharded_step(
    config: PretrainedConfig | str,
    seq_len: int,
    *,
    world_size: int = 1,
    cpu_offload: bool = False,
    master_dtype: torch.dtype = torch.float32,
    compute_dtype: torch.dtype | None = torch.bfloat16,
    reshard_after_forward: bool = True,
    loss: Literal["plain", "chunked"] = "chunked",
    checkpointing: Checkpointing | None = "offload",
    tiled_mlp: bool = True,
    mlp_tiles: int | None = None,
    optimizer: bool = True,
) -> MemoryReport:
    """Simulate one FSDP2 training step of a causal LM and return rank 0's device and host peaks.

    Args:
        config: a ``transformers`` config or a preset name (see :mod:`lit_memtrain.models.presets`).
        seq_len: tokens in each rank's row.
        world_size: ranks the model is sharded over.
        cpu_offload: keep sharded parameters, gradients and AdamW state in host memory (the optimizer
            steps there).
        master_dtype: dtype of the sharded parameters, their gradients and the AdamW state.
        compute_dtype: dtype the parameters are gathered in for compute (``MixedPrecisionPolicy``
            ``param_dtype``, gradients reduced in ``master_dtype``); ``None`` computes in ``master_dtype``.
        reshard_after_forward: as for :class:`~lit_memtrain.strategies.FSDP2Strategy`.
        loss, checkpointing, tiled_mlp, mlp_tiles: the techniques, as in
            :func:`~lit_memtrain.planner.simulate.simulate_step`.
        optimizer: include the AdamW state and its step.

    Example:
        >>> report = simulate_sharded_step("qwen3-4b", 524288, cpu_offload=True)  # doctest: +SKIP
        >>> round(report.device_peak_gib, 1)  # doctest: +SKIP
    """
    if world_size < 1 or seq_len < 1:
        raise ValueError(f"world_size and seq_len must be positive, got {world_size} and {seq_len}.")
    fake_process_group(world_size)
    from torch.distributed.device_mesh import init_device_mesh

    device = stand_in_device()
    mesh = init_device_mesh(device.type, (world_size,), mesh_dim_names=("data_parallel",))
    mp_policy = None if compute_dtype is None else MixedPrecisionPolicy(compute_dtype, master_dtype)
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = fake_causal_lm(config, master_dtype)
        model.tie_weights()  # materialising on the stand-in device gives a tied head a parameter of its own
        parallelize(
            model,
            mesh,
            mp_policy=mp_policy,
            offload_policy=CPUOffloadPolicy(pin_memory=False) if cpu_offload else None,
            reshard_after_forward=reshard_after_forward,
        )
        layers = find_decoder_layers(model)
        if checkpointing is not None:
            apply_checkpointing(layers, selective=checkpointing == "selective", offload=checkpointing == "offload")
        if tiled_mlp:
            apply_tiled_mlp(layers, mlp_tiles)
        adamw = torch.optim.AdamW(model.parameters(), foreach=True) if optimizer else None
        if adamw is not None:  # the state exists before the step, as in every step after the first
            for param in model.parameters():
                param.grad = torch.zeros_like(param)
            adamw.step()
            adamw.zero_grad(set_to_none=True)
        inputs = {
            "input_ids": torch.zeros((1, seq_len), dtype=torch.long, device=device),
            "position_ids": torch.arange(seq_len, device=device)[None],
        }
        targets = torch.zeros(seq_len, dtype=torch.long, device=device)
        tracked = (model, *inputs.values(), targets) + ((adamw,) if adamw is not None else ())
        return measure_peak(lambda: _step(model, adamw, inputs, targets, loss), *tracked)
