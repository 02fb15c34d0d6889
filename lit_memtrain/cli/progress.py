"""The training progress bar of ``lit-memtrain fit``: optimizer steps over the whole fit, not batches of an epoch.

Why: a fit is usually bounded by ``max_steps`` (every shipped config is), where Lightning's bars count the
batches of the current epoch and its rich bar reads "Epoch 0/-2" (``max_epochs`` is -1 under ``max_steps``). This
bar counts optimizer steps up to Lightning's own estimate of the fit's total (``max_steps``, or the steps of
``max_epochs`` epochs, whichever ends the fit first; gradient accumulation counted), continues from a resumed
checkpoint's step, and names the epoch it is in.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm, convert_inf

__all__ = ["StepProgressBar"]


class StepProgressBar(TQDMProgressBar):
    """Lightning's tqdm bar, its training bar counting optimizer steps of the whole fit (see the module docstring).

    Example:
        >>> trainer = Trainer(max_steps=1000, callbacks=[StepProgressBar()])  # doctest: +SKIP
        Epoch 2:  45%|████▌     | 450/1000 [01:02<01:16, 7.20step/s, train/loss=1.93]
    """

    def __init__(self, refresh_rate: int = 1, process_position: int = 0) -> None:
        super().__init__(refresh_rate, process_position)  # one bar for the whole fit: no bar left per epoch

    def init_train_tqdm(self) -> Tqdm:
        bar = super().init_train_tqdm()
        bar.unit = "step"
        return bar

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self.train_progress_bar.reset(total=convert_inf(trainer.estimated_stepping_batches))
        self.train_progress_bar.initial = trainer.global_step
        self.train_progress_bar.n = trainer.global_step

    def on_train_epoch_start(self, trainer: Trainer, *_: Any) -> None:
        self.train_progress_bar.set_description(f"Epoch {trainer.current_epoch}")

    def print(self, *args: Any, sep: str = " ", **kwargs: Any) -> None:
        """Above the open bar, or plainly once both are closed: Lightning's bar writes only through an open bar, so
        what the module prints when training ends (its loss summary, where it exported) was lost."""
        if any(bar is not None and not bar.disable for bar in (self._train_progress_bar, self._val_progress_bar)):
            super().print(*args, sep=sep, **kwargs)
        else:
            print(*args, sep=sep, **kwargs)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        bar = self.train_progress_bar
        if not bar.disable and step != bar.n and self._should_update(step, bar.total):
            bar.n = step
            bar.refresh()
            bar.set_postfix(self.get_metrics(trainer, pl_module))
