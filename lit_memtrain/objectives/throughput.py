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

:class:`ThroughputMeter` turns these counts into what a module logs while training: the tokens trained so far
over all ranks (``train/tokens``) and, over each window of ``log_every_n_steps`` optimizer steps, tokens/s, model
FLOP/s and MFU, synchronising the device once per window rather than once per batch.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from lit_memtrain.datamodules.batch import CU_SEQ_LENS_ON_HOST, host_document_starts
from lit_memtrain.objectives.peak_flops import dense_peak_flops

__all__ = [
    "ThroughputMeter",
    "attention_pairs",
    "count_tokens",
    "matmul_parameters",
    "peak_flops",
    "summed_over_ranks",
    "training_flops",
]


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
    if CU_SEQ_LENS_ON_HOST in batch:  # the collator's host copy (checked against the batch): no device read
        bounds = host_document_starts(batch).long()
        lengths = bounds[1:] - bounds[:-1]
    elif "cu_seq_lens_q" in batch:
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


def training_flops(
    model: nn.Module, tokens: int | Tensor, pairs: int | Tensor, parameters: float | None = None
) -> float:
    """Model FLOPs of one training pass (forward and backward) over ``tokens`` with ``pairs`` attention pairs;
    ``parameters``: the model's :func:`matmul_parameters`, where counted already (a pass over every parameter)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    width = config.num_attention_heads * head_dim
    if parameters is None:
        parameters = matmul_parameters(model)
    return 6.0 * parameters * int(tokens) + 12.0 * config.num_hidden_layers * width * int(pairs)


def peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """The device's dense peak FLOP/s in ``dtype``: from :data:`~lit_memtrain.objectives.peak_flops.DENSE_PEAK_FLOPS`
    for the data-centre GPUs it lists (H100, H200, GH200, L40S, A100), else from Lightning's table of accelerators;
    ``None`` on a CPU or an accelerator neither knows (MFU is then not reported)."""
    if device.type not in ("cuda", "xla"):
        return None
    if device.type == "cuda":
        dense = dense_peak_flops(torch.cuda.get_device_name(device), dtype)
        if dense is not None:
            return dense
    from lightning.fabric.utilities.throughput import get_available_flops

    flops = get_available_flops(device, dtype)
    return float(flops) if flops else None


def summed_over_ranks(
    tokens: int | Tensor, world_size: int, device: torch.device, reduce: Callable[..., Tensor]
) -> int | Tensor:
    """A count summed over all ``world_size`` ranks, by one all-reduce of one number without the barrier of a
    strategy's ``reduce`` (no wait for the device); ``reduce(tensor, reduce_op="sum")`` (a Lightning strategy's)
    only where torch.distributed has no process group (XLA's own reduce). Each rank counts the tokens it holds
    (its own rows, or its shard of its group's rows under context parallelism), so the sum counts each once."""
    if world_size == 1:
        return tokens
    total = tokens.detach().clone() if isinstance(tokens, Tensor) else torch.tensor(tokens, device=device)
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return reduce(total, reduce_op="sum")
    torch.distributed.all_reduce(total)
    return total


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _compute_dtype(precision: str, model: nn.Module) -> torch.dtype:
    """The dtype the matrix multiplications run in: the precision's 16-bit one (mixed or true), else the model's."""
    if precision.startswith("bf16"):
        return torch.bfloat16
    if precision.startswith("16"):
        return torch.float16
    return model.dtype


class ThroughputMeter:
    """The tokens a run has trained, and its throughput over windows of optimizer steps.

    Counts are kept as the batches give them (host ints, or device tensors read only at a measurement), so
    counting a batch never waits for the device; a measurement synchronises the device once, at the end of
    each window, and its metrics are logged then (Lightning reports a value logged at a step at every later step
    of the epoch until it is logged again).

    Attributes:
        tokens_seen: real tokens of all training batches so far, summed over the ranks (an ``int``, or a 0-d
            device tensor until read).
        metrics: the latest measurement: ``train/tokens_per_sec`` (over all ranks, what ``tokens_seen`` rose
            by), ``train/device/tokens_per_sec``, ``train/device/flops_per_sec`` and, where the device's peak is
            known (not on CPU), ``train/device/mfu``.
    """

    def __init__(self) -> None:
        self.tokens_seen: int | Tensor = 0
        self.metrics: dict[str, float] = {}
        self._started_at = 0.0
        self._tokens: int | Tensor = 0
        self._pairs: int | Tensor = 0
        self._seen_from: int | Tensor = 0
        self._measured_at_step = 0
        # The model whose matmul_parameters were counted, and the count: a model's parameters keep their shapes
        # through a fit, and counting walks every module (a millisecond a window for 28 layers).
        self._counted: tuple[weakref.ref[nn.Module], float] | None = None

    def start(self, device: torch.device, step: int) -> None:
        """Open the first window at optimizer step ``step`` (0, or where a resumed run restarts)."""
        _synchronize(device)
        self._started_at, self._tokens, self._pairs = time.perf_counter(), 0, 0
        self._seen_from = self.tokens_seen
        self._measured_at_step = step

    def count(
        self, batch: Mapping[str, Any], world_size: int, device: torch.device, reduce: Callable[..., Tensor]
    ) -> None:
        """Add a training batch: its real tokens and attention pairs on this device, and its tokens summed over
        the ``world_size`` ranks to :attr:`tokens_seen` (:func:`summed_over_ranks`, with the strategy's ``reduce``)."""
        tokens = count_tokens(batch)
        self.tokens_seen = self.tokens_seen + summed_over_ranks(tokens, world_size, device, reduce)
        self._tokens = self._tokens + tokens
        self._pairs = self._pairs + attention_pairs(batch)

    def update(
        self, step: int, every: int, max_steps: int, model: nn.Module, device: torch.device, precision: str
    ) -> dict[str, float]:
        """The metrics measured anew when optimizer step ``step`` ends a window: every ``every`` steps
        (Lightning's ``log_every_n_steps``) and at the last (``max_steps``, when positive); an empty dict at any
        other step (the latest stay in :attr:`metrics`).

        ``model`` gives the FLOPs per token (:func:`training_flops`), ``device`` and ``precision`` (Lightning's
        precision string) the peak MFU is measured against.
        """
        last = 0 < max_steps <= step
        if step != self._measured_at_step and (step % every == 0 or last):
            self.metrics = self._measure(model, device, _compute_dtype(precision, model))
            self._measured_at_step = step
            return self.metrics
        return {}

    def _measure(self, model: nn.Module, device: torch.device, dtype: torch.dtype) -> dict[str, float]:
        _synchronize(device)
        now = time.perf_counter()
        elapsed = max(now - self._started_at, 1e-9)
        tokens = int(self._tokens)
        total = int(self.tokens_seen) - int(self._seen_from)  # what train/tokens rose by
        if self._counted is None or self._counted[0]() is not model:
            self._counted = (weakref.ref(model), matmul_parameters(model))
        flops_per_sec = training_flops(model, tokens, self._pairs, self._counted[1]) / elapsed
        metrics = {
            "train/tokens_per_sec": total / elapsed,
            "train/device/tokens_per_sec": tokens / elapsed,
            "train/device/flops_per_sec": flops_per_sec,
        }
        peak = peak_flops(device, dtype)
        if peak:
            metrics["train/device/mfu"] = flops_per_sec / peak
        self._started_at, self._tokens, self._pairs = now, 0, 0
        self._seen_from = self.tokens_seen
        return metrics

    def tokens_seen_metric(self) -> Tensor:
        """:attr:`tokens_seen` as a metric to log: float64 (exact to 2**53 tokens, where float32 rounds past 2**24,
        a count a multi-rank run passes in minutes) where the device has it; a count kept on the device stays
        there (no sync), one kept in Python becomes a host tensor."""
        seen = self.tokens_seen
        if not isinstance(seen, Tensor):
            return torch.tensor(seen, dtype=torch.float64)
        return seen.to(torch.float32 if seen.device.type == "mps" else torch.float64)
