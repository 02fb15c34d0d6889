"""Lightning callback that saves a checkpoint when SIGTERM stops a fit, and says what happened.

Why: SIGTERM is how a fit is asked to stop (a scheduler's preemption, ``wandb sweep`` stopping a run, ``kill``).
Lightning then ends the fit after the step running when the signal came (its ``SIGTERMException``), but saves nothing
unless a ``ModelCheckpoint`` has ``save_on_exception``, and says only ``Received SIGTERM``: a preempted run lost its
steps since the last periodic checkpoint, and the log did not say whether it can be resumed. This callback saves the
stopped fit as ``sigterm-step=<N>.ckpt`` in every checkpoint folder (which ``--ckpt_path last`` resumes, as the
highest step there), or says that checkpointing is off and nothing was saved.

The stop comes between steps: a signal that arrives while a step runs takes effect when that step's torch call
returns (Python runs signal handlers between bytecodes), so a long step delays it by up to one step.

Usage::

    trainer = Trainer(callbacks=[ModelCheckpoint(dirpath="out/checkpoints", save_last=True), SigtermCheckpoint()])

``lit-memtrain fit`` adds it and exits with status 143 (128 + SIGTERM) after it.
"""

from __future__ import annotations

from pathlib import Path

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import SIGTERMException

__all__ = ["SigtermCheckpoint"]


class SigtermCheckpoint(Callback):
    """On SIGTERM, save the fit in each ``ModelCheckpoint``'s folder and log one line saying where (or that nothing
    was saved because checkpointing is off)."""

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        if not isinstance(exception, SIGTERMException):
            return
        callbacks = [c for c in trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint) and c.dirpath]
        folders = sorted({str(callback.dirpath) for callback in callbacks})
        saved = []
        for folder in folders:
            path = Path(folder) / f"sigterm-step={trainer.global_step}.ckpt"
            trainer.save_checkpoint(path)
            saved.append(str(path))
        where = (
            f"saved {', '.join(saved)} (--ckpt_path last resumes it)"
            if saved
            else "checkpointing is off, so nothing was saved (--trainer.enable_checkpointing=true saves on SIGTERM)"
        )
        rank_zero_info(f"SIGTERM: the fit stopped after step {trainer.global_step}; {where}")
