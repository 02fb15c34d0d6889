"""Lightning callback that saves a checkpoint when SIGTERM stops a fit, and says what happened.

Why: SIGTERM is how a fit is asked to stop (a scheduler's preemption, ``wandb sweep`` stopping a run, ``kill``).
Lightning then ends the fit after the step running when the signal came (its ``SIGTERMException``), but saves nothing
unless a ``ModelCheckpoint`` has ``save_on_exception``, and says only ``Received SIGTERM``: a preempted run lost its
steps since the last periodic checkpoint, and the log did not say whether it can be resumed. This callback saves the
stopped fit as ``sigterm-step=<N>.ckpt`` in every checkpoint folder (which ``--ckpt_path last`` resumes, as the
highest step there), or says that checkpointing is off and nothing was saved.

The stop comes between optimizer steps: a signal that arrives while a step runs takes effect when that step's torch
call returns (Python runs signal handlers between bytecodes), so a long step delays it by up to one step. With gradient
accumulation Lightning would stop after the *micro-batch* running, in the middle of an optimizer step: the gradients
accumulated so far are in no checkpoint, so the resumed run would take that step on the rest of its micro-batches only
and silently train differently from an uninterrupted run. This callback holds the stop back until the optimizer step
ends (up to ``accumulate_grad_batches - 1`` micro-batches later, or the epoch's end; for a module that accumulates
across batches itself, until its window is closed), then saves.

Usage::

    trainer = Trainer(callbacks=[ModelCheckpoint(dirpath="out/checkpoints", save_last=True), SigtermCheckpoint()])

``lit-memtrain fit`` adds it and exits with status 143 (128 + SIGTERM) after it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import SIGTERMException

__all__ = ["SigtermCheckpoint"]


class SigtermCheckpoint(Callback):
    """On SIGTERM, save the fit in each ``ModelCheckpoint``'s folder and log one line saying where (or that nothing
    was saved because checkpointing is off)."""

    def __init__(self) -> None:
        self._step_at_batch_start: int | None = None
        self._held = False  # a SIGTERM came in the middle of an optimizer step: the stop waits for its end
        self._mid_step = False  # the last micro-batch ended inside an optimizer step

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._step_at_batch_start = trainer.global_step

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Hold a SIGTERM back while an optimizer step is open, and let it through once the step has been taken.

        Lightning checks its flag right after this hook (and, with several ranks, rank 0's flag before each batch).
        A batch closes a step when ``global_step`` moved during it (automatic and manual optimisation alike), or when
        it is the epoch's last (Lightning steps on an epoch's short last window), unless the module reports an
        accumulation window still open (``accumulation_window_open``).
        """
        last_batch = trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
        stepped = trainer.global_step != self._step_at_batch_start or last_batch
        # A module that accumulates across batches itself (manual optimisation) may step and open the next window in
        # one batch: it says so (OnlineRLModule.accumulation_window_open).
        stepped = stepped and not getattr(pl_module, "accumulation_window_open", False)
        self._mid_step = not stepped
        signals = getattr(trainer, "_signal_connector", None)  # Lightning's own flag has no public setter
        if signals is None:
            return
        if stepped and self._held:
            signals.received_sigterm = True
            self._held = False
        elif not stepped and signals.received_sigterm:
            signals.received_sigterm = False
            self._held = True

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        if not isinstance(exception, SIGTERMException):
            return
        if self._mid_step:  # the signal slipped in after on_train_batch_end: the open step's gradients are lost
            rank_zero_warn(
                f"SIGTERM stopped the fit in the middle of optimizer step {trainer.global_step + 1} (gradient "
                "accumulation): its micro-batches so far are not in the checkpoint, so a resumed run takes that step "
                "on the rest of them only and is not exactly the uninterrupted run."
            )
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
