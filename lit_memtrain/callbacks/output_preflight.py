"""Lightning callback that checks, before the first step, that a fit's outputs can be written.

Why: a read-only or full output folder otherwise shows only when it is written, after the training it was meant to
keep: a traceback at the first checkpoint, or at the export once every step has run (with checkpointing off, as
in the quickstart, the trained run is then lost). Each folder the fit writes (the checkpoints' folders, the
loggers', the module's ``export_dir``; local ones) is made and written to, and each filesystem must have room for one
checkpoint and one export as estimated from the model, before any step runs.

The estimates: a checkpoint holds the saved parameters (only the trainable ones when the module saves adapter
only) and two fp32 optimizer states per trainable parameter (AdamW's); an export holds every parameter in its own
dtype. Only global rank 0 checks; every rank stops together.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections import defaultdict
from pathlib import Path

from lightning.pytorch import Callback, LightningModule, Trainer

__all__ = ["OutputPreflight"]

_MIB = 2**20
_ADAM_STATE_BYTES = 8  # two fp32 moments per trainable parameter


class OutputPreflight(Callback):
    """Refuse to start a fit whose output folders cannot be written or lack room for a checkpoint and an export.

    ``lit-memtrain fit`` adds it. In Python::

        trainer = Trainer(callbacks=[ModelCheckpoint(dirpath="out/checkpoints"), OutputPreflight()])

    Raises (at fit start):
        PermissionError: a folder cannot be made or written to (which, and why).
        OSError: a filesystem has less room than the outputs written to it need (figures in MiB).
    """

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        problem = self.check(trainer, pl_module) if trainer.is_global_zero else None
        problem = trainer.strategy.broadcast(problem, src=0)
        if problem:
            kind, message = problem
            raise (PermissionError if kind == "write" else OSError)(message)

    @staticmethod
    def check(trainer: Trainer, pl_module: LightningModule) -> tuple[str, str] | None:
        """(``"write"`` or ``"room"``, the message) for the first problem found; None when the outputs fit."""
        checkpoint, export = estimated_sizes(pl_module)
        needs: dict[Path, int] = {}
        for callback in trainer.checkpoint_callbacks:
            if _is_local(getattr(callback, "dirpath", None)):
                needs[Path(callback.dirpath)] = checkpoint
        export_dir = (getattr(pl_module, "hparams", None) or {}).get("export_dir")
        if _is_local(export_dir):
            needs[Path(export_dir).parent] = needs.get(Path(export_dir).parent, 0) + export
        for logger in trainer.loggers:
            folder = logger.log_dir or logger.save_dir
            if _is_local(folder):
                needs.setdefault(Path(folder), 0)
        by_filesystem: dict[int, list[tuple[Path, int]]] = defaultdict(list)
        for folder, need in needs.items():
            error = _write_error(folder)
            if error:
                return "write", f"{folder} cannot be written ({error}); the fit would fail when it writes there."
            by_filesystem[folder.stat().st_dev].append((folder, need))
        for folders in by_filesystem.values():
            need = sum(size for _, size in folders)
            free = shutil.disk_usage(folders[0][0]).free
            if need > free:
                names = ", ".join(f"{folder} ({size / _MIB:,.1f} MiB)" for folder, size in folders if size)
                return "room", (
                    f"Not enough room: {names} need about {need / _MIB:,.1f} MiB on one filesystem and "
                    f"{free / _MIB:,.1f} MiB are free. Free some space or write the outputs elsewhere."
                )
        return None


def estimated_sizes(pl_module: LightningModule) -> tuple[int, int]:
    """Bytes of one checkpoint and of one export of ``pl_module``'s model (see the module docstring)."""
    total = trainable = trainable_bytes = 0
    for parameter in pl_module.parameters():
        size = parameter.numel() * parameter.element_size()
        total += size
        if parameter.requires_grad:
            trainable += parameter.numel()
            trainable_bytes += size
    saved = trainable_bytes if getattr(pl_module, "adapter_only_checkpoints", False) else total
    return saved + trainable * _ADAM_STATE_BYTES, total


def _is_local(folder: object) -> bool:
    """Whether ``folder`` is given and on this machine (not ``s3://`` and the like, which are not checked)."""
    return bool(folder) and "://" not in str(folder)


def _write_error(folder: Path) -> str | None:
    """Why ``folder`` cannot be made or written to, or None."""
    if folder.exists() and not folder.is_dir():
        return "it is a file, not a folder"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        descriptor, probe = tempfile.mkstemp(dir=folder, prefix=".lit-memtrain-write-check-")
        os.close(descriptor)
        os.unlink(probe)
    except OSError as error:
        return error.strerror or str(error)
    return None
