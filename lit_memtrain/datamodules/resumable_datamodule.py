"""ResumableDataModule: a datamodule whose training dataloader resumes mid-epoch from a checkpoint.

Why a base class: the position of the training dataloader is datamodule state that Lightning saves through
``state_dict`` / ``load_state_dict``, and restoring it needs the loader the datamodule built last and the
trainer it runs under. SFT and preference data share that logic (and its workaround for Lightning's FSDP
restore order) instead of each keeping a copy.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader

from lit_memtrain.datamodules.resumable import ResumableDataLoader, ResumableSampler
from lit_memtrain.datamodules.validation_shares import UnscoredRepeats, ValidationShares

__all__ = ["ResumableDataModule"]


class ResumableDataModule(LightningDataModule):
    """A LightningDataModule whose training dataloader, built by :meth:`resumable_train_loader`, continues
    where a checkpoint left it.

    Example:
        >>> class MyData(ResumableDataModule):
        ...     def train_dataloader(self):
        ...         return self.resumable_train_loader(data, batch_size=8, collate_fn=collate, seed=0)  # doctest: +SKIP
    """

    _train_loader: ResumableDataLoader | None = None
    _train_loader_state: dict[str, Any] | None = None

    def data_parallel(self) -> tuple[int, int]:
        """(replicas, rank) of data parallelism: what Lightning's own sampler would use (1, 0 without a trainer)."""
        trainer = self.trainer
        kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None) if trainer is not None else None
        kwargs = kwargs or {}
        return int(kwargs.get("num_replicas", 1)), int(kwargs.get("rank", 0))

    def _consumed_batches(self) -> int:
        """Batches of the current epoch that the trainer has run a step on (Lightning fetches one ahead)."""
        return self.trainer.fit_loop.epoch_loop.batch_progress.current.processed

    def _epoch_batches(self) -> float:
        """Batches the trainer runs per epoch (``limit_train_batches`` applied; infinite for an endless stream)."""
        return self.trainer.num_training_batches

    def resumable_train_loader(
        self,
        dataset: Any,
        batch_size: int,
        collate_fn: Any,
        seed: int | None = None,
        num_workers: int = 0,
        drop_last: bool = False,
    ) -> ResumableDataLoader:
        """The training loader, at the position of a checkpoint being restored if there is one.

        With ``seed``, map-style ``dataset`` is shuffled and split over the data-parallel ranks by a
        :class:`ResumableSampler`; without, ``dataset`` is a stream read in order (it shards itself).
        ``drop_last``: each epoch trains only whole batches of every rank (``batch_size * world_size`` rows, as
        many as ``len(dataset) // (batch_size * world_size)``; no row repeated to even out the ranks).
        """
        sampler = None
        if seed is not None:
            replicas, rank = self.data_parallel()
            sampler = ResumableSampler(
                dataset, num_replicas=replicas, rank=rank, shuffle=True, seed=seed, drop_last=drop_last
            )
        loader = ResumableDataLoader(
            dataset,
            batch_size=batch_size,
            sampler=sampler,
            drop_last=drop_last,
            collate_fn=collate_fn,
            num_workers=num_workers,
            persistent_workers=num_workers > 0,
            consumed_batches=self._consumed_batches if self.trainer is not None else None,
            epoch_batches=self._epoch_batches if self.trainer is not None else None,
        )
        if self._train_loader_state is not None:
            loader.load_state_dict(self._train_loader_state)
            self._train_loader_state = None
        self._train_loader = loader
        return loader

    def validation_loader(
        self,
        dataset: Any,
        batch_size: int,
        collate_fn: Any,
        unscored: Callable[[Any], Any],
        num_workers: int = 0,
    ) -> DataLoader:
        """The validation loader of map-style ``dataset``: this data-parallel rank's share of its rows, in order,
        evened out over the ranks with repeats whose targets ``unscored`` blanks, so that no row is scored twice
        (:mod:`lit_memtrain.datamodules.validation_shares`)."""
        rows = UnscoredRepeats(dataset, unscored)
        replicas, rank = self.data_parallel()
        return DataLoader(
            rows,
            batch_size=batch_size,
            sampler=ValidationShares(rows, num_replicas=replicas, rank=rank),
            collate_fn=collate_fn,
            num_workers=num_workers,
            persistent_workers=num_workers > 0,
        )

    def state_dict(self) -> dict[str, Any]:
        """The training dataloader's position, saved in checkpoints so a resumed run continues mid-epoch."""
        if self._train_loader is None:
            return {}
        return {"train_loader": self._train_loader.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume the training dataloader from a checkpoint's position.

        Lightning restores the datamodule before it builds the dataloaders, except with strategies that
        restore after their setup (FSDP, ModelParallel) when ``configure_optimizers`` reads
        ``trainer.estimated_stepping_batches``: the loader has then been iterated already and Lightning
        drops the saved position (Lightning issue #20550). In that case the loader takes the position
        and Lightning's fetcher is started again from it.
        """
        loader_state = state_dict.get("train_loader")
        if loader_state is None:
            return
        fetcher = getattr(self.trainer.fit_loop, "_data_fetcher", None) if self.trainer is not None else None
        combined = getattr(fetcher, "_combined_loader", None)
        if self._train_loader is not None and combined is not None and self._train_loader in combined.flattened:
            self._train_loader.load_state_dict(loader_state)
            iter(fetcher)
        else:
            self._train_loader_state = loader_state
