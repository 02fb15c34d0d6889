"""Lightning callback logging the memory of every training step, and recording one step in full on request.

Why: every technique in lit-memtrain trades time for memory, and the number that decides whether a
sequence length fits is the peak of a step, not the memory at the moment a logger samples it. On CUDA the
peak counters are reset at the start of each optimizer step (its first micro-batch) and read at the end of every
micro-batch, so the value logged at a step is the peak of all its micro-batches' forwards and backwards and its
optimizer step. Under gradient accumulation Lightning passes to the logger only what is logged at a step's last
micro-batch: counters reset at every micro-batch would report that one alone, and miss a larger micro-batch
before it (rows of different lengths). On the CPU the process RSS is logged instead. Each value is one process's
device (Lightning's loggers write rank 0's): ranks of a sharded or context-parallel fit may peak higher, which
:class:`~lit_memtrain.callbacks.MemoryBoundedThroughput` bounds (the largest over the ranks).

``snapshot_step=N`` records the CUDA allocator's history during optimizer step ``N`` (all its
micro-batches) and writes ``memory_snapshot_step{N}.pickle`` (open it at pytorch.org/memory_viz) and
``memory_timeline_step{N}.png`` (:func:`lit_memtrain.techniques.memory_timeline.render_memory_timeline`).
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_only, rank_zero_warn

from lit_memtrain.techniques.memory_timeline import render_memory_timeline

__all__ = ["MemoryMonitor"]

_GIB = 2**30


def _process_rss_bytes() -> int:
    import psutil

    return psutil.Process().memory_info().rss


class MemoryMonitor(Callback):
    """Log peak device memory per optimizer step (GiB, logger and progress bar); snapshot one step on request.

    Logged keys: ``memory/peak_allocated_gib`` and ``memory/peak_reserved_gib`` on CUDA, ``memory/rss_gib``
    on the CPU.

    Args:
        snapshot_step: optimizer step (``trainer.global_step``) whose allocator history to record (CUDA only).
        snapshot_dir: directory for the snapshot pickle and the timeline PNG; required with ``snapshot_step``.
        max_snapshot_entries: most allocator events kept while recording (older ones are dropped).

    Example:
        >>> from lit_memtrain.callbacks.memory_monitor import MemoryMonitor
        >>> trainer = Trainer(callbacks=[MemoryMonitor(snapshot_step=3, snapshot_dir="memory")])  # doctest: +SKIP
    """

    def __init__(
        self,
        snapshot_step: int | None = None,
        snapshot_dir: str | Path | None = None,
        max_snapshot_entries: int = 1_000_000,
    ) -> None:
        if snapshot_step is not None and (
            isinstance(snapshot_step, bool) or not isinstance(snapshot_step, int) or snapshot_step < 0
        ):
            raise ValueError(f"snapshot_step must be an int >= 0 or None, got {snapshot_step!r}.")
        if snapshot_step is not None and snapshot_dir is None:
            raise ValueError(
                f"snapshot_step={snapshot_step} needs snapshot_dir: the directory for the snapshot and its timeline."
            )
        if max_snapshot_entries < 1:
            raise ValueError(f"max_snapshot_entries must be >= 1, got {max_snapshot_entries}.")
        self.snapshot_step = snapshot_step
        self.snapshot_dir = None if snapshot_dir is None else Path(snapshot_dir)
        self.max_snapshot_entries = max_snapshot_entries
        self.snapshot_paths: tuple[Path, Path] | None = None
        self._recording = False
        self._snapshot_taken = False
        self._peak_step: int | None = None  # the optimizer step the peak counters were last reset for

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._peak_step = None
        if self.snapshot_step is not None and pl_module.device.type != "cuda":
            rank_zero_warn(
                f"MemoryMonitor(snapshot_step={self.snapshot_step}) records CUDA allocator history; training runs "
                f"on {pl_module.device.type}, so no snapshot will be written."
            )

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if pl_module.device.type != "cuda":
            return
        if trainer.global_step != self._peak_step:  # the first micro-batch of an optimizer step
            torch.cuda.reset_peak_memory_stats(pl_module.device)
            self._peak_step = trainer.global_step
        if self.snapshot_step == trainer.global_step and not self._recording and not self._snapshot_taken:
            torch.cuda.memory._record_memory_history(stacks="python", max_entries=self.max_snapshot_entries)
            self._recording = True

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if pl_module.device.type == "cuda":
            metrics = {
                "memory/peak_allocated_gib": torch.cuda.max_memory_allocated(pl_module.device) / _GIB,
                "memory/peak_reserved_gib": torch.cuda.max_memory_reserved(pl_module.device) / _GIB,
            }
        else:
            metrics = {"memory/rss_gib": _process_rss_bytes() / _GIB}
        pl_module.log_dict(metrics, prog_bar=True, on_step=True, on_epoch=False, batch_size=1)
        if self._recording and trainer.global_step > self.snapshot_step:
            self._finish_snapshot(pl_module)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._recording:
            self._finish_snapshot(pl_module)

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        if self._recording:
            torch.cuda.memory._record_memory_history(enabled=None)
            self._recording = False

    def _finish_snapshot(self, pl_module: LightningModule) -> None:
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        self._recording = False
        self._snapshot_taken = True
        self.snapshot_paths = self._write_snapshot(snapshot, pl_module.device.index or 0)

    @rank_zero_only
    def _write_snapshot(self, snapshot: dict[str, Any], device: int) -> tuple[Path, Path]:
        self.snapshot_dir.mkdir(parents=True, exist_ok=True)
        pickle_path = self.snapshot_dir / f"memory_snapshot_step{self.snapshot_step}.pickle"
        png_path = self.snapshot_dir / f"memory_timeline_step{self.snapshot_step}.png"
        with pickle_path.open("wb") as file:
            pickle.dump(snapshot, file)
        render_memory_timeline(snapshot, png_path, device=device, title=f"Device memory, step {self.snapshot_step}")
        return pickle_path, png_path
