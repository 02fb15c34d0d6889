"""One process on the whole row against a context-parallel group on the same row: loss and every gradient.

The group runs in processes started with ``torch.multiprocessing`` (forked with gloo, so they do not import
torch and transformers again; spawned with nccl, as CUDA cannot be used in a forked child); each case builds its
model from the same seed on every rank and on the reference side, so the weights are equal.
The reference is plain transformers (``sdpa``, which keeps packed documents apart by their position ids) on the
unsharded row with targets shifted the usual way: nothing of ``lit_memtrain.parallel.context_parallel`` is on that side.
"""

from __future__ import annotations

import contextlib
import copy
import os
import socket
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from transformers import AutoModelForCausalLM

from lit_memtrain.techniques.checkpointing import apply_checkpointing
from lit_memtrain.parallel.context_parallel import install_attention, shard_batch, torch_ring_attention
from lit_memtrain.datamodules.padding_free import PaddingFreeCollator
from lit_memtrain.models.layers import find_decoder_layers
from lit_memtrain.models.presets import build_config
from lit_memtrain.techniques.loss import chunked_cross_entropy
from lit_memtrain.techniques.tiled_mlp import apply_tiled_mlp

YARN = {"rope_type": "yarn", "rope_theta": 1_000_000.0, "factor": 4.0, "original_max_position_embeddings": 16}


@dataclass(frozen=True)
class Case:
    """One comparison: ``lengths`` are the documents of one packed row (one length: a single-document row)."""

    name: str
    method: str
    lengths: tuple[int, ...]
    preset: str = "tiny-qwen3"
    overrides: dict[str, Any] = field(default_factory=dict)
    inner: str = "sdpa_by_document"
    loss: str = "float64"  # "float64": logits and cross-entropy in float64; "chunked": chunked_cross_entropy
    checkpointing: dict[str, bool] | None = None  # apply_checkpointing's options ({} = full checkpointing)
    tiled_mlp: bool = False
    batch_rows: int = 1  # > 1: that many single-document rows of lengths[0] tokens
    cp: int = 2  # ranks 0 .. cp - 1 of the started processes form the group; the others wait
    dtype: str = "float64"
    ring_backend: str = "all_gather"


def build_model(case: Case, device: torch.device | str = "cpu") -> torch.nn.Module:
    config = build_config(case.preset, {"num_hidden_layers": 2, **case.overrides})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=getattr(torch, case.dtype))
    return model.to(device).train()


def build_batch(case: Case, vocab_size: int, device: torch.device | str = "cpu") -> dict[str, Any]:
    batch = _cpu_batch(case, vocab_size)
    return {key: value.to(device) if key != "cu_seq_lens_q" and torch.is_tensor(value) else value
            for key, value in batch.items()}  # fmt: skip


def _cpu_batch(case: Case, vocab_size: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(1)
    if case.batch_rows > 1:
        ids = torch.randint(0, vocab_size, (case.batch_rows, case.lengths[0]), generator=generator)
        labels = ids.clone()
        labels[:, :3] = -100  # a prompt
        return {"input_ids": ids, "labels": labels}
    examples = []
    for length in case.lengths:
        ids = torch.randint(0, vocab_size, (length,), generator=generator)
        labels = ids.clone()
        labels[: length // 3] = -100  # a prompt
        examples.append({"input_ids": ids, "labels": labels})
    if len(examples) == 1:
        return {"input_ids": examples[0]["input_ids"][None], "labels": examples[0]["labels"][None]}
    return PaddingFreeCollator()(examples)


def _loss(model: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, count: torch.Tensor, kind: str):
    if kind == "chunked":
        return chunked_cross_entropy(hidden.flatten(0, 1), model.lm_head.weight, targets.flatten(), count, chunk_size=8)
    logits = model.lm_head(hidden).flatten(0, 1)
    return F.cross_entropy(logits, targets.flatten(), ignore_index=-100, reduction="sum") / count


def reference(case: Case, model: torch.nn.Module, batch: dict[str, Any]) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss and gradients of one process on the whole batch."""
    model.zero_grad()
    hidden = model.model(
        input_ids=batch["input_ids"], position_ids=batch.get("position_ids"), use_cache=False
    ).last_hidden_state
    targets = F.pad(batch["labels"][:, 1:], (0, 1), value=-100)
    loss = _loss(model, hidden, targets, (targets != -100).sum(), case.loss)
    loss.backward()
    return loss.item(), {name: p.grad.cpu() for name, p in model.named_parameters()}


def context_parallel(
    case: Case, model: torch.nn.Module, batch: dict[str, Any], group: dist.ProcessGroup
) -> tuple[float, dict[str, torch.Tensor], int]:
    """Loss (summed over the group), gradients (summed over the group) and padding, for this rank's shard."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    if case.checkpointing is not None:
        apply_checkpointing(find_decoder_layers(model), **case.checkpointing)
    if case.tiled_mlp:
        apply_tiled_mlp(find_decoder_layers(model), num_tiles=3)
    attention = install_attention(model, group, case.method, inner=case.inner, ring_backend=case.ring_backend)
    shard = shard_batch(batch, rank, size, case.method)
    attention.set_layout(shard.layout)
    model.zero_grad()
    with contextlib.ExitStack() as stack:
        if case.ring_backend == "torch":  # open from the forward through the backward
            stack.enter_context(torch_ring_attention(DeviceMesh.from_group(group, "cuda"), shard.layout))
        hidden = model.model(
            input_ids=shard.batch["input_ids"], position_ids=shard.batch["position_ids"], use_cache=False
        ).last_hidden_state
        targets = shard.batch["shift_labels"]
        count = (targets != -100).sum()
        dist.all_reduce(count, group=group)  # the row's trainable targets: each rank divides by all of them
        loss = _loss(model, hidden, targets, count, case.loss)
        loss.backward()
    attention.uninstall()
    total = loss.detach().clone()
    dist.all_reduce(total, group=group)
    grads = {}
    for name, param in model.named_parameters():
        dist.all_reduce(param.grad, group=group)
        grads[name] = param.grad.cpu()
    return total.item(), grads, shard.layout.padding


def _error(action) -> str:
    try:
        action()
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def misuse(group: dist.ProcessGroup) -> dict[str, str]:
    """The error each misuse raises on this rank (all of them before any collective)."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    case = Case("misuse", "ulysses", (16,))
    model = build_model(case)
    batch = build_batch(case, model.config.vocab_size)
    shard = shard_batch(batch, rank, size, "ulysses")
    errors = {"flash_missing": _error(lambda: install_attention(model, group, "ulysses", inner="flash_attention_2"))}
    packed = shard_batch(build_batch(Case("packed", "ulysses", (9, 7)), model.config.vocab_size), rank, size, "ulysses")
    attention = install_attention(model, group, "ulysses", inner="sdpa")
    errors["sdpa_packed"] = _error(lambda: attention.set_layout(packed.layout))
    attention.uninstall()
    attention = install_attention(model, group, "ulysses")

    def forward(ids, **kwargs):
        positions = shard.batch["position_ids"][:, : ids.shape[1]]
        return model.model(input_ids=ids, position_ids=positions, use_cache=False, **kwargs)

    errors["before_set_layout"] = _error(lambda: forward(shard.batch["input_ids"]))
    errors["ring_layout"] = _error(lambda: attention.set_layout(shard_batch(batch, rank, size, "ring").layout))
    errors["installed_twice"] = _error(lambda: install_attention(model, group, "ulysses"))
    attention.set_layout(shard.layout)
    errors["stale_layout"] = _error(lambda: forward(shard.batch["input_ids"][:, :4]))
    # without position ids the model numbers each shard from 0: right on rank 0 only, yet every rank must raise
    errors["no_positions"] = _error(lambda: model.model(input_ids=shard.batch["input_ids"], use_cache=False))
    mask = torch.ones_like(shard.batch["input_ids"])
    errors["attention_mask"] = _error(lambda: forward(shard.batch["input_ids"], attention_mask=mask))
    attention.uninstall()
    errors["uninstalled"] = model.config._attn_implementation
    bad = build_model(Case("bad", "ulysses", (16,), overrides={"num_attention_heads": 3, "num_key_value_heads": 1}))
    errors["heads"] = _error(lambda: install_attention(bad, group, "ulysses"))
    wide = build_model(Case("wide", "ulysses", (16,), overrides={"head_dim": 320}))
    errors["flash_head_dim"] = _error(lambda: install_attention(wide, group, "ulysses", inner="flash_attention_2"))
    return errors


def _worker(rank: int, world_size: int, port: int, cases: list[Case], output: str, backend: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=rank, world_size=world_size)
    # One group per size, of the first ranks (every rank takes part in creating every group).
    groups = {size: dist.new_group(list(range(size))) for size in sorted({case.cp for case in cases} | {2})}
    results: dict[str, Any] = {}
    try:
        for case in cases:
            if rank < case.cp:
                try:
                    model = build_model(case, device)
                    batch = build_batch(case, model.config.vocab_size, device)
                    expected = reference(case, copy.deepcopy(model), batch)
                    loss, grads, padding = context_parallel(case, model, batch, groups[case.cp])
                    results[case.name] = {"reference": expected, "cp": (loss, grads), "padding": padding}
                except Exception as error:  # reported per case; the other ranks raise the same error
                    results[case.name] = {"error": f"{type(error).__name__}: {error}", "trace": traceback.format_exc()}
            dist.barrier()  # every case ends on every rank: no rank is left inside a collective
        if rank < 2 and backend == "gloo":
            results["misuse"] = misuse(groups[2])
        dist.barrier()
        if rank == 0:
            torch.save(results, output)
    finally:
        dist.destroy_process_group()


def run_cases(cases: list[Case], directory: Path, backend: str = "gloo") -> dict[str, Any]:
    """Run every case on forked ranks (as many as the largest ``cp``); rank 0's results by case name.

    ``backend="nccl"`` spawns the ranks instead and puts rank ``r`` on ``cuda:r``.
    """
    world_size = max(case.cp for case in cases)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    output = str(directory / "results.pt")
    start_method = "spawn" if backend == "nccl" else "fork"
    mp.start_processes(_worker, args=(world_size, port, cases, output, backend), nprocs=world_size,
                       start_method=start_method)  # fmt: skip
    return torch.load(output, weights_only=False)
