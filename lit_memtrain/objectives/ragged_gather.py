"""Every rank's values when ranks hold different numbers of them: what TRL's ``pad_across_processes`` + ``gather``
does for the high-entropy token mask's quantile (one micro-batch's trained tokens differ in number per rank).

Example:
    >>> every_rank_values(torch.tensor([0.5, 2.0]), module.all_gather, trainer.world_size)  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

__all__ = ["every_rank_values"]


def every_rank_values(values: Tensor, all_gather: Callable[[Tensor], Tensor], world_size: int) -> Tensor:
    """The 1-D ``values`` of every rank, concatenated rank after rank (this rank's alone on one process)."""
    if world_size == 1:
        return values
    counts = all_gather(torch.tensor(values.numel(), device=values.device)).flatten()
    padded = values.new_zeros(int(counts.max()))
    padded[: values.numel()] = values
    gathered = all_gather(padded)  # [world, longest]
    return torch.cat([row[: int(count)] for row, count in zip(gathered, counts)])
