"""A DataLoader that a resumed run continues exactly where the checkpoint left it, mid-epoch.

Why: a plain DataLoader has no position, so Lightning restarts a resumed run at the beginning of the
epoch (a long-context epoch can take days). Lightning saves and restores any training dataloader that has
``state_dict`` / ``load_state_dict``; this one has them, and its position is what was *trained on*, not
what was fetched: Lightning fetches one batch ahead of the step for iterables without a length, so the
position is taken from Lightning's own count of processed batches when the loader runs under a trainer.

- Map-style data: a :class:`ResumableSampler`, a ``DistributedSampler`` (each data-parallel rank its own
  share, so Lightning leaves it in place) whose order is a function of ``(seed, epoch)`` only. Resuming
  sets the epoch and skips the indices of the batches already trained on, without loading them.
- A :class:`~lit_memtrain.datamodules.streaming.PackedStream`: the stream's own position after each
  batch is kept for the last few batches; under DDP every rank's position is gathered into the state.

Usage::

    loader = ResumableDataLoader(dataset, batch_size=8, sampler=ResumableSampler(dataset, seed=0))
    state = loader.state_dict()   # after some batches
    loader.load_state_dict(state)  # the next iteration continues from there
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler

_POSITIONS_KEPT = 64


class ResumableSampler(DistributedSampler):
    """Indices of one data-parallel rank, in an order fixed by ``(seed, epoch)``, able to start mid-epoch.

    ``start`` skips that many of this rank's indices at the next iteration only (the loader sets it when
    resuming). Defaults to one replica, so it runs without ``torch.distributed``.
    """

    def __init__(
        self,
        dataset: Any,
        num_replicas: int = 1,
        rank: int = 0,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
        self.start = 0

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        start, self.start = self.start, 0
        return iter(indices[start:])


class ResumableDataLoader(DataLoader):
    """A DataLoader with ``state_dict`` / ``load_state_dict`` that Lightning saves in checkpoints.

    An epoch ends where the trainer ends it (``epoch_batches``: Lightning's ``num_training_batches``, which
    ``limit_train_batches`` cuts), not only where the data ends: a checkpoint taken after an epoch's last batch
    resumes at the start of the next epoch, as the trainer does. A stream has no end of its own: each epoch
    continues it where the previous one stopped (it never starts again from its first rows).

    Args:
        consumed_batches: returns how many batches of the current epoch were trained on (the datamodule
            passes Lightning's progress counter); without it, the batches yielded so far.
        epoch_batches: returns how many batches an epoch trains on (the datamodule passes Lightning's
            ``num_training_batches``; infinite for an endless stream); without it, the length of the loader.
        Other arguments are the DataLoader's. Map-style data needs a :class:`ResumableSampler`; a
        :class:`PackedStream` needs ``num_workers=0``.
    """

    def __init__(
        self,
        *args: Any,
        consumed_batches: Callable[[], int] | None = None,
        epoch_batches: Callable[[], float] | None = None,
        **kwargs: Any,
    ) -> None:
        # Each iteration draws its workers' base seed from this generator, not from torch's global one: a resumed fit
        # restores the global generator's state and starts a new iteration, which must not draw from it
        # (lit_memtrain.objectives.rng_state).
        kwargs.setdefault("generator", torch.Generator().manual_seed(0))
        super().__init__(*args, **kwargs)
        from lit_memtrain.datamodules.streaming import PackedStream  # pyarrow: imported when a loader is made

        self.consumed_batches = consumed_batches
        self.epoch_batches = epoch_batches
        self._streaming = streaming = isinstance(self.dataset, PackedStream)
        if not streaming and not isinstance(self.sampler, ResumableSampler):
            raise ValueError("ResumableDataLoader needs a ResumableSampler for map-style data.")
        if streaming and self.num_workers:
            raise ValueError("A PackedStream is read in order by the training process: use num_workers=0.")
        self._pending: dict[str, Any] | None = None
        self._epoch = 0
        self._yielded = 0
        self._positions: dict[int, Any] = {}


    def state_dict(self) -> dict[str, Any]:
        """The position after the batches trained on so far: ``{"epoch", "batches"}`` (and ``"stream"``)."""
        consumed = self.consumed_batches() if self.consumed_batches is not None else self._yielded
        epoch_ended = consumed >= self._batches_per_epoch()
        if not self._streaming:
            if epoch_ended:
                return {"epoch": self._epoch + 1, "batches": 0}
            # What the count of batches means: another split or batch size would skip other rows (load_state_dict).
            return {"epoch": self._epoch, "batches": consumed, "replicas": self.sampler.num_replicas,
                    "batch_size": self.batch_size, **self._order()}  # fmt: skip
        state = {"epoch": self._epoch, "batches": consumed, "stream": self._stream_position(consumed)}
        state["layout"] = self._order()
        if epoch_ended:  # the next epoch continues the stream from there, counting its batches from 0
            state.update(epoch=self._epoch + 1, batches=0)
        if _world_size() > 1:  # each rank reads its own shard of the stream: keep every rank's position
            states: list[Any] = [None] * _world_size()
            torch.distributed.all_gather_object(states, state)
            return {"ranks": states}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Make the next iteration continue from ``state`` (taken by :meth:`state_dict`)."""
        if "ranks" in state:
            ranks = state["ranks"]
            if len(ranks) != _world_size():
                raise ValueError(
                    f"The checkpoint holds the stream positions of {len(ranks)} ranks but this run has "
                    f"{_world_size()}: resume a streamed run with the same number of processes."
                )
            state = ranks[torch.distributed.get_rank()]
        if self._streaming != ("stream" in state):
            kind = "a stream" if "stream" in state else "map-style data"
            raise ValueError(f"The dataloader state was saved for {kind}, which this run does not read.")
        if not self._streaming and state.get("batches"):
            self._check_same_split(state)
        if self._streaming or state.get("batches"):  # a stream's position always points into its rows
            self._check_same_order(state.get("layout", state) if self._streaming else state)
        self._pending = dict(state)

    def _order(self) -> dict[str, Any]:
        """What else a position is counted in: the rows and their order (map-style: how many there are and the
        shuffle's seed; a stream: the batch size and how it cuts, packs and shuffles its windows)."""
        if self._streaming:
            return {"batch_size": self.batch_size, **self.dataset.layout}
        return {"rows": len(self.dataset), "seed": self.sampler.seed}

    def _check_same_order(self, saved: dict[str, Any]) -> None:
        """Refuse a position in rows laid out otherwise (another max_length, window or seed; data that tokenizes to
        another number of rows): the same count of batches would point at other examples, skipping some and
        repeating others, silently. Checkpoints of earlier versions hold none of these: nothing to compare."""
        now = self._order()
        changed = [f"{name}={saved[name]!r} then, {value!r} now" for name, value in now.items()
                   if saved.get(name, value) != value]  # fmt: skip
        if changed:
            raise ValueError(
                f"The checkpoint's position in the training data counts rows laid out otherwise "
                f"({', '.join(changed)}): resuming from it would skip some examples and repeat others. Resume with "
                "the settings of the checkpointed run, or start a new run from the checkpoint's weights."
            )

    def _check_same_split(self, state: dict[str, Any]) -> None:
        """Refuse a mid-epoch position counted in other units: each rank skips ``batches * batch_size`` of its own
        share of the epoch's order, so with another number of data-parallel ranks or another batch size it would
        skip rows no rank trained on and train again on rows the run had trained on, silently."""
        saved = (state.get("replicas", self.sampler.num_replicas), state.get("batch_size", self.batch_size))
        if saved != (self.sampler.num_replicas, self.batch_size):
            raise ValueError(
                f"The checkpoint was saved in the middle of an epoch by {saved[0]} data-parallel rank(s) with "
                f"batch_size={saved[1]}; this run has {self.sampler.num_replicas} with batch_size={self.batch_size}, "
                "which would skip other rows than those trained on. Resume it with the same number of processes and "
                "batch_size, or from a checkpoint saved at the end of an epoch."
            )

    def __iter__(self) -> Iterator[Any]:
        state, self._pending = self._pending, None
        if state is None:
            epoch, batches = getattr(self.sampler, "epoch", 0), 0
            stream_position = None
            if self._streaming and self._positions:  # a new epoch: the stream goes on after the last one's batches
                stream_position = self._stream_position(min(self._yielded, self._batches_per_epoch()))
                if stream_position is not None:
                    self.dataset.load_state_dict(stream_position)
        else:
            epoch, batches, stream_position = state["epoch"], state["batches"], state.get("stream")
            if self._streaming:
                if stream_position is not None:
                    self.dataset.load_state_dict(stream_position)
            else:
                self.sampler.set_epoch(epoch)
                self.sampler.start = batches * self.batch_size
        self._epoch, self._yielded = epoch, batches
        self._positions = {batches: stream_position}
        return self._track(super().__iter__())

    def _batches_per_epoch(self) -> float:
        """Batches an epoch trains on: the trainer's count when given (``limit_train_batches`` applied), else all."""
        if self.epoch_batches is not None:
            return self.epoch_batches() if self._streaming else min(self.epoch_batches(), len(self))
        return float("inf") if self._streaming else len(self)

    def _stream_position(self, batches: int) -> Any:
        """The stream's position after ``batches`` batches of the current epoch."""
        if batches not in self._positions:
            raise RuntimeError(
                f"The stream position after batch {batches} is not known (kept: {sorted(self._positions)}); "
                "a checkpoint must be taken while the training dataloader is being iterated."
            )
        return self._positions[batches]

    def _track(self, batches: Iterator[Any]) -> Iterator[Any]:
        for batch in batches:
            self._yielded += 1
            if self._streaming:
                self._positions[self._yielded] = self.dataset.current_position
                self._positions.pop(self._yielded - _POSITIONS_KEPT, None)
            yield batch


def _world_size() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return 1
