"""A reward model's step in plain torch: where each sequence's reward is read, the Bradley-Terry loss, the metrics.

Why apart from the module: these are functions of token ids and of reward vectors, so they are tested against
transformers' and TRL's own computations without a Lightning module, and the planner's fake tensors run them as
they are (no shape depends on a value: no device sync).

Conventions follow TRL's ``RewardTrainer``: a batch's rewards are ``[chosen of every pair; rejected of every
pair]``; the loss is ``-mean log sigmoid(r_chosen - r_rejected - margin)`` (``margin`` only when the data has that
column) plus ``center_rewards_coefficient * mean((r_chosen + r_rejected)^2)`` when the coefficient is set; the
metrics are ``accuracy`` (strictly ``r_chosen > r_rejected``), ``margin`` (mean ``r_chosen - r_rejected``, without
the data's margin), the mean chosen and rejected rewards, and the mean, min and max over all rewards.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "PAIR_MEANS",
    "REWARD_METRICS",
    "bradley_terry_losses",
    "last_token_positions",
    "metrics_from_statistics",
    "pair_values",
    "step_statistics",
]

# Metrics that are means over pairs of pair_values' entries, then those over all rewards; "loss" comes first.
PAIR_MEANS = ("accuracy", "margin", "rewards/chosen", "rewards/rejected")
REWARD_METRICS = ("loss", *PAIR_MEANS, "mean_reward", "min_reward", "max_reward")


def last_token_positions(input_ids: Tensor, sequence_ids: Tensor, sequences: int, pad_token_id: int) -> Tensor:
    """``[sequences]``: the flat index of each sequence's reward token in ``input_ids`` (any shape, read flat).

    The reward token is the sequence's rightmost token whose id is not ``pad_token_id``, as transformers'
    ``*ForSequenceClassification`` reads a right-padded row: so with ``pad == eos`` a trailing eos counts as
    padding and the reward comes from the token before it, in a padded row, in a padding-free one (where padding
    never ends a document) and in an exported model alike. A sequence made only of pad ids is read at its first
    token, as transformers reads it. ``sequence_ids`` (same shape, :class:`~lit_memtrain.datamodules.
    preference_collate.PreferenceCollator`'s) names each token's sequence, ``sequences`` being padding.
    """
    flat_ids, owners = input_ids.flatten(), sequence_ids.flatten()
    index = torch.arange(flat_ids.numel(), device=flat_ids.device)
    kept = torch.where(flat_ids != pad_token_id, index, -1)
    last = torch.full((sequences + 1,), -1, dtype=index.dtype, device=index.device)
    last = last.scatter_reduce(0, owners, kept, "amax")
    first = torch.full((sequences + 1,), flat_ids.numel(), dtype=index.dtype, device=index.device)
    first = first.scatter_reduce(0, owners, index, "amin")
    return torch.where(last >= 0, last, first)[:sequences]


def bradley_terry_losses(
    chosen: Tensor, rejected: Tensor, margin: Tensor | None = None, center_rewards_coefficient: float | None = None
) -> Tensor:
    """Each pair's term of TRL's reward loss (each argument ``[B]``, the result too): ``-log sigmoid(chosen -
    rejected - margin)``, plus ``center_rewards_coefficient * (chosen + rejected)^2`` when that is set (it pulls the
    rewards towards zero mean, TRL advises 0.01). Their mean is the loss of the batch; a validation metric over
    pairs weighs each pair's term.

    Example:
        >>> bradley_terry_losses(torch.tensor([2.0, 0.0]), torch.tensor([0.0, 0.0]))
        tensor([0.1269, 0.6931])
    """
    gap = chosen - rejected
    if margin is not None:
        gap = gap - margin.to(gap)
    losses = -F.logsigmoid(gap)
    if center_rewards_coefficient is not None:
        losses = losses + center_rewards_coefficient * (chosen + rejected) ** 2
    return losses


def pair_values(chosen: Tensor, rejected: Tensor) -> dict[str, Tensor]:
    """Per-pair values whose means over pairs are the metrics :data:`PAIR_MEANS` (each ``[B]``)."""
    return {
        "accuracy": (chosen > rejected).to(chosen.dtype),
        "margin": chosen - rejected,
        "rewards/chosen": chosen,
        "rewards/rejected": rejected,
    }


def step_statistics(loss: Tensor, chosen: Tensor, rejected: Tensor) -> Tensor:
    """``[8]``: what one rank's batch adds to a step's metrics: its pairs, its loss summed over them, the sums of
    :func:`pair_values`, and its smallest and largest reward; one tensor, so that ranks exchange it in one gather."""
    pairs = chosen.new_full((), chosen.numel(), dtype=torch.float32)  # a fill: no host-to-device copy
    rewards = torch.cat([chosen, rejected]).float()
    sums = [value.float().sum() for value in pair_values(chosen, rejected).values()]
    return torch.stack([pairs, loss.float() * pairs, *sums, rewards.min(), rewards.max()])


def metrics_from_statistics(statistics: Tensor) -> dict[str, Tensor]:
    """:data:`REWARD_METRICS` of all pairs whose :func:`step_statistics` are the rows of ``statistics``
    (``[ranks, 8]``, or ``[8]`` for one), each pair weighing the same."""
    statistics = statistics.reshape(-1, 8)
    pairs = statistics[:, 0].sum()
    means = statistics[:, 1:6].sum(0) / pairs
    metrics = dict(zip(("loss", *PAIR_MEANS), means.unbind()))
    metrics["mean_reward"] = (metrics["rewards/chosen"] + metrics["rewards/rejected"]) / 2
    metrics["min_reward"] = statistics[:, 6].min()
    metrics["max_reward"] = statistics[:, 7].max()
    return metrics
