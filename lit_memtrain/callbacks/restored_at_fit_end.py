"""The base of the callbacks that change the model when a fit starts and must put it back when the fit ends.

Why one base: checkpointing, tiled MLPs, chunked norms and compiled layers each replace ``forward`` methods for
the fit only; exporting or generating afterwards, and a fit that failed, must see the plain model. Each sets
``self._restore`` (the function its technique returned) when it applies itself; it runs once, at ``teardown`` or
at ``on_exception``, whichever comes first.
"""

from __future__ import annotations

from collections.abc import Callable

from lightning.pytorch import Callback, LightningModule, Trainer

__all__ = ["RestoredAtFitEnd"]


class RestoredAtFitEnd(Callback):
    """A callback whose change to the model (``self._restore`` undoes it) is undone when the fit ends.

    Example:
        >>> class Doubled(RestoredAtFitEnd):  # doctest: +SKIP
        ...     def on_fit_start(self, trainer, pl_module):
        ...         self._restore = apply_my_transform(pl_module)
    """

    _restore: Callable[[], None] | None = None

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._undo()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._undo()

    def _undo(self) -> None:
        if self._restore is not None:
            self._restore()
            self._restore = None
