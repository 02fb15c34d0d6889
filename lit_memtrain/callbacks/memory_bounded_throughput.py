"""MemoryBoundedThroughput: one number for a W&B sweep, training speed under a memory bound.

Why: a sweep optimises a single metric, but the question it answers here has two parts, "as fast as
possible" and "within N GiB". This callback folds them into ``sweep/objective``: the run's tokens per second
after warm-up when its peak memory stayed within ``max_memory_gib``, 0 when it did not. A run over the bound
thus scores worst instead of vanishing from the search, and the search learns to avoid its region.

Throughput is measured over the whole window, not averaged per step: tokens counted from the batches from
step ``warmup_steps`` on, divided by the wall time from that step's start to the end of training, with the
device synchronised at both ends only (CUDA runs asynchronously, so per-step timers without a sync
misattribute time). Tokens are read from the batch itself (``num_tokens``, else the ``attention_mask``, else
``input_ids``), so the callback works on any LightningModule with dict batches, and summed on the device. The window's wall time includes whatever else the trainer does meanwhile (validation, checkpoint
saving), which a sweep's base config should leave out.

Peak memory is the largest peak seen at the end of any training batch: on CUDA the caching allocator's
reserved bytes (what the device must hold; a run needing more than the card has fails with an
out-of-memory error), elsewhere the process's resident memory. Across ranks, tokens are summed and the
largest peak is the one bounded.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lit_memtrain.objectives.throughput import count_tokens

GIB = 2**30


def peak_memory_bytes(device: torch.device) -> int:
    """Peak reserved bytes of the CUDA caching allocator on ``device``, or the process's resident memory."""
    if device.type == "cuda":
        return torch.cuda.max_memory_reserved(device)
    import psutil

    return psutil.Process().memory_info().rss


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class MemoryBoundedThroughput(Callback):
    """At the end of training, log tokens/sec after warm-up, the peak memory, and the sweep objective.

    Logged once, at ``trainer.global_step``, to every logger: ``sweep/tokens`` (tokens in the measured
    window, all ranks), ``sweep/tokens_per_sec``, ``sweep/peak_memory_gib``, ``sweep/within_memory_bound``
    (1 or 0) and ``sweep/objective`` (``tokens_per_sec`` within the bound, else 0); and one line saying them
    (``sweep/objective 812.3: ...``), which ``benchmarks/sweep_grid.py`` reads without W&B.

    Args:
        max_memory_gib: the memory bound, in GiB per device.
        warmup_steps: optimizer steps left out of the throughput (allocator growth, kernel autotuning and
            compilation make the first steps slow); they still count for the peak memory.

    Example:
        >>> trainer = Trainer(max_steps=50, callbacks=[MemoryBoundedThroughput(max_memory_gib=22)])  # doctest: +SKIP
    """

    def __init__(self, max_memory_gib: float, warmup_steps: int = 3) -> None:
        if max_memory_gib <= 0:
            raise ValueError(f"max_memory_gib must be a positive number of GiB, got {max_memory_gib}.")
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"warmup_steps must be an int >= 0, got {warmup_steps!r}.")
        self.max_memory_gib = max_memory_gib
        self.warmup_steps = warmup_steps
        self._started_at: float | None = None
        self._tokens: int | torch.Tensor = 0
        self._peak_bytes = 0

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._started_at, self._tokens, self._peak_bytes = None, 0, 0

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if trainer.global_step < self.warmup_steps:
            return
        if self._started_at is None:
            _synchronize(pl_module.device)
            self._started_at = time.perf_counter()
        if not isinstance(batch, dict) or not {"num_tokens", "attention_mask", "input_ids"} & batch.keys():
            found = sorted(batch) if isinstance(batch, dict) else type(batch).__name__
            raise ValueError(
                "MemoryBoundedThroughput counts a batch's tokens from its num_tokens, attention_mask or input_ids, and "
                f"this fit's batches have none ({found}): an online-RL batch holds prompts, its trained tokens are "
                "generated inside the step. Use it on fits whose batches hold the tokens they train (SFT, DPO, "
                "reward models), or leave it out."
            )
        self._tokens = self._tokens + count_tokens(batch)  # a device tensor when counted there: no sync

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._peak_bytes = max(self._peak_bytes, peak_memory_bytes(pl_module.device))

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        _synchronize(pl_module.device)
        elapsed = time.perf_counter() - self._started_at if self._started_at is not None else 0.0
        device = pl_module.device
        tokens = int(trainer.strategy.reduce(torch.as_tensor(self._tokens, device=device), reduce_op="sum"))
        peak_gib = float(trainer.strategy.all_gather(torch.tensor(self._peak_bytes, device=device)).max()) / GIB
        if not trainer.is_global_zero:
            return
        if elapsed == 0.0:
            rank_zero_warn(
                f"MemoryBoundedThroughput measured nothing: training ended at step {trainer.global_step}, before "
                f"warmup_steps={self.warmup_steps}. Train longer or lower warmup_steps."
            )
            return
        tokens_per_sec = tokens / elapsed
        within = peak_gib <= self.max_memory_gib
        metrics = {
            "sweep/tokens": float(tokens),
            "sweep/tokens_per_sec": tokens_per_sec,
            "sweep/peak_memory_gib": peak_gib,
            "sweep/within_memory_bound": float(within),
            "sweep/objective": tokens_per_sec if within else 0.0,
        }
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)
        bound = "within" if within else "over"
        rank_zero_info(
            f"sweep/objective {metrics['sweep/objective']:.1f}: {tokens_per_sec:.1f} tokens/s after "
            f"{self.warmup_steps} warm-up steps, peak memory {peak_gib:.2f} GiB "
            f"({bound} max_memory_gib={self.max_memory_gib:g})"
        )
