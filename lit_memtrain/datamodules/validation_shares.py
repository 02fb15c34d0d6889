"""ValidationShares: each data-parallel rank's share of the validation rows, no row scored twice.

Why: every rank must run as many validation batches as the others (FSDP2 gathers the layers of each forward
across ranks, so a rank with a batch fewer would leave the others waiting), so when the rows do not divide by the
ranks some ranks need one row more than there is. Lightning's own ``DistributedSampler`` fills the gap by
repeating the first rows, and every metric over all ranks then counts those rows twice: the validation loss of two
ranks is not the loss of the set. Here the extra rows are repeats too (the same shapes, the same work), but with
nothing to score: the datamodule's ``unscored`` function blanks their targets (an SFT row's labels become
``IGNORE_INDEX``), so a metric over every rank is the metric of the whole set, as one process computes it.

Lightning leaves a ``DistributedSampler`` that a dataloader already has in place; the datamodule builds one per
rank from the strategy's ``distributed_sampler_kwargs`` (context-parallel ranks of one group get the same rows).

A validation stream is dealt the same way by :class:`StreamShares`, as it is read: every rank reads it whole (the
number of rows is known only at its end, and every rank must know it to run as many batches as the others), keeps
the rows the sampler would give it and ends with the blanked repeats the sampler would add.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from torch.utils.data import Dataset, DistributedSampler, IterableDataset

__all__ = ["StreamShares", "UnscoredRepeats", "ValidationShares"]


class UnscoredRepeats(Dataset):
    """``dataset``'s rows, then, from index ``len(dataset)`` on, repeats of its rows from the first (around again
    if needed) with their targets blanked by ``unscored`` (what :class:`ValidationShares` asks for to even out the
    ranks).

    ``len()`` is the number of real rows, which is what the sampler divides over the ranks.
    """

    def __init__(self, dataset: Any, unscored: Callable[[Any], Any]) -> None:
        self.dataset = dataset
        self.unscored = unscored

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        rows = len(self.dataset)
        if index < rows:
            return self.dataset[index]
        return self.unscored(self.dataset[(index - rows) % rows])  # fewer rows than ranks: around again


class ValidationShares(DistributedSampler):
    """Indices of one rank's validation rows, in order, as ``DistributedSampler(shuffle=False)`` deals them, with
    the indices past the end pointing at :class:`UnscoredRepeats`' blanked repeats instead of the first rows.

    Example:
        >>> rows = UnscoredRepeats(list(range(5)), unscored=lambda row: -1)
        >>> [rows[i] for i in ValidationShares(rows, num_replicas=2, rank=1)]
        [1, 3, -1]
    """

    def __init__(self, dataset: UnscoredRepeats, num_replicas: int = 1, rank: int = 0) -> None:
        if not isinstance(dataset, UnscoredRepeats):
            raise TypeError(
                f"ValidationShares deals the rows of an UnscoredRepeats dataset, got {type(dataset).__name__}: "
                "wrap the validation rows in UnscoredRepeats(rows, unscored)."
            )
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=False, drop_last=False)

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.rank, self.total_size, self.num_replicas))


class StreamShares(IterableDataset):
    """One rank's share of a validation ``stream`` that every rank reads whole: rows ``rank``, ``rank +
    num_replicas``, ..., then the blanked repeats (``unscored``) that even the ranks out, the very rows
    :class:`ValidationShares` deals of the same rows in a list. Holds at most ``num_replicas`` rows (the first ones,
    which the repeats copy).

    Example:
        >>> [row for row in StreamShares(range(5), unscored=lambda row: -1, num_replicas=2, rank=1)]
        [1, 3, -1]
    """

    def __init__(
        self, stream: Iterable[Any], unscored: Callable[[Any], Any], num_replicas: int = 1, rank: int = 0
    ) -> None:
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank must be in [0, num_replicas={num_replicas}), got {rank}.")
        self.stream = stream
        self.unscored = unscored
        self.num_replicas = num_replicas
        self.rank = rank

    def __iter__(self) -> Iterator[Any]:
        replicas, first_rows, rows = self.num_replicas, [], 0
        for index, row in enumerate(self.stream):
            if index < replicas:
                first_rows.append(row)
            if index % replicas == self.rank:
                yield row
            rows = index + 1
        evened = -(-rows // replicas) * replicas
        for index in range(rows + (self.rank - rows) % replicas, evened, replicas):
            yield self.unscored(first_rows[(index - rows) % rows])
