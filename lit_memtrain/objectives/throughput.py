"""Counting what a training batch costs: real tokens and model FLOPs, without a device sync.

Why here: throughput numbers are read by the module (``train/tokens_per_sec``, MFU) and by callbacks that must
work on any LightningModule (``MemoryBoundedThroughput``), so they come from the batch and the model alone.
Counting on the device (``attention_mask.sum()``) and converting to a Python number waits for the GPU to
finish the queued work; these helpers return a device tensor in that case, and a plain ``int`` only when the
number is already on the host.

Model FLOPs follow the convention of Lightning's ``ThroughputMonitor`` and the PaLM paper's MFU: per trained
token, 6 FLOPs per parameter that multiplies it (forward 2, backward 4; mixture-of-experts weights count for
the share of experts a token visits, the input embedding lookup counts nothing, the LM head counts even when
tied), plus causal attention: 12 FLOPs per layer, per attention width and per earlier token of the same
document (``QK^T`` and ``AV``, forward and backward). Checkpointing's recomputation is not counted (it is
not model work), so MFU is the share of the device's peak spent on the model's own arithmetic.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["attention_pairs", "count_tokens", "matmul_parameters", "peak_flops", "training_flops"]


def count_tokens(batch: Mapping[str, Any]) -> int | Tensor:
    """Real (non-padding) input tokens of a batch: an ``int`` when known on the host, else a 0-d tensor.

    Reads ``num_tokens`` (padding-free batches), else the ``attention_mask`` sum, else counts ``input_ids``.
    """
    if "num_tokens" in batch:
        count = batch["num_tokens"]
        return int(count) if not isinstance(count, Tensor) or count.device.type == "cpu" else count
    if "attention_mask" in batch:
        total = batch["attention_mask"].sum()
        return int(total) if total.device.type == "cpu" else total
    return batch["input_ids"].numel()


def attention_pairs(batch: Mapping[str, Any]) -> int | Tensor:
    """Query-key pairs causal attention computes for a batch: ``sum of L * (L + 1) / 2`` over its documents;
    an ``int`` when the documents' lengths are on the host, else a 0-d tensor on their device.

    Documents are the segments of ``cu_seq_lens_q`` (padding-free rows), else the rows' real lengths
    (``attention_mask``), else whole rows. A sequence shard of a context-parallel group carries its share of
    its rows' pairs as ``attention_pairs``.
    """
    if "attention_pairs" in batch:
        return batch["attention_pairs"]
    if "cu_seq_lens_q" in batch:
        bounds = torch.as_tensor(batch["cu_seq_lens_q"]).long()
        lengths = bounds[1:] - bounds[:-1]
    elif "attention_mask" in batch:
        lengths = batch["attention_mask"].sum(dim=-1).long()
    else:
        ids = batch["input_ids"]
        lengths = torch.full((ids.shape[0] if ids.dim() > 1 else 1,), ids.shape[-1], dtype=torch.long)
    pairs = (lengths * (lengths + 1) // 2).sum()
    return int(pairs) if pairs.device.type == "cpu" else pairs


def matmul_parameters(model: nn.Module) -> float:
    """Parameters that multiply each token: all matrices but the input embedding, the LM head included
    (tied or not), expert weights scaled by ``num_experts_per_tok / num_experts``."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    expert_share = getattr(config, "num_experts_per_tok", 1) / experts if experts else 1.0
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    total = 0.0
    for name, param in model.named_parameters():
        if param.dim() < 2 or param is embedding:
            continue
        total += param.numel() * (expert_share if ".experts." in f".{name}." else 1.0)
    if head is not None and head.weight is embedding:
        total += embedding.numel()
    return total


def training_flops(model: nn.Module, tokens: int | Tensor, pairs: int | Tensor) -> float:
    """Model FLOPs of one training pass (forward and backward) over ``tokens`` with ``pairs`` attention pairs."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    width = config.num_attention_heads * head_dim
    return 6.0 * matmul_parameters(model) * int(tokens) + 12.0 * config.num_hidden_layers * width * int(pairs)


def peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """The device's peak FLOP/s in ``dtype`` from Lightning's table of accelerators; ``None`` on a CPU or an
    accelerator the table does not know (MFU is then not reported)."""
    if device.type not in ("cuda", "xla"):
        return None
    from lightning.fabric.utilities.throughput import get_available_flops

    flops = get_available_flops(device, dtype)
    return float(flops) if flops else None
