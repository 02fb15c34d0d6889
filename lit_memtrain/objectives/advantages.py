"""Rewards to advantages for online RL: GRPO's group-relative advantages and RLOO's leave-one-out baseline.

Why plain functions: the formulas are TRL's (``GRPOTrainer`` / ``RLOOTrainer`` of TRL 1.16, the
``sum_then_normalize`` and ``normalize_then_sum`` aggregations), and each is checked on its own in tests against
hand-computed values or TRL; the modules only gather the rewards and call them.

Layout: a generation batch holds ``num_generations`` completions per prompt, adjacent (completions ``g * G`` to
``g * G + G - 1`` answer prompt ``g``). A reward of ``NaN`` means "not scored" (every reward function returned
``None``): it is left out of the group statistics and its advantage is 0, never ``NaN``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

__all__ = [
    "SCALE_REWARDS",
    "GroupAdvantages",
    "ScaleRewards",
    "combine_rewards",
    "group_relative_advantages",
    "leave_one_out_advantages",
    "nanstd",
    "normalize_then_sum_advantages",
]

ScaleRewards = Literal["group", "batch", "none"]
SCALE_REWARDS = ("group", "batch", "none")
_STD_EPSILON = 1e-4  # TRL's: a group of equal rewards gets advantage 0 / (0 + 1e-4) = 0, not NaN


def nanstd(values: Tensor, dim: int | None = None, keepdim: bool = False) -> Tensor:
    """Standard deviation ignoring NaN, with Bessel's correction (``N - 1``); NaN where fewer than two values count.

    Example:
        >>> nanstd(torch.tensor([1.0, 3.0, float("nan")]))
        tensor(1.4142)
    """
    mean = torch.nanmean(values, dim=dim, keepdim=True)
    variance = torch.nanmean((values - mean) ** 2, dim=dim, keepdim=True)
    count = (~torch.isnan(values)).sum(dim=dim, keepdim=True)
    correction = torch.where(count > 1, count / (count - 1), torch.full_like(variance, float("nan")))
    std = torch.sqrt(variance * correction)
    if keepdim:
        return std
    return std.squeeze(dim) if dim is not None else std.squeeze()


def combine_rewards(rewards_per_function: Tensor, weights: Tensor) -> Tensor:
    """``[N]``: the weighted sum of each completion's rewards ``[N, K]`` (NaN, "not scored", counts as 0), NaN
    where every function left the completion unscored."""
    if rewards_per_function.dim() != 2 or weights.shape != (rewards_per_function.shape[1],):
        raise ValueError(
            f"rewards_per_function must be [completions, functions] and weights [functions], got "
            f"{tuple(rewards_per_function.shape)} and {tuple(weights.shape)}."
        )
    rewards = (rewards_per_function * weights.to(rewards_per_function).unsqueeze(0)).nansum(dim=1)
    return rewards.masked_fill(torch.isnan(rewards_per_function).all(dim=1), float("nan"))


@dataclass(frozen=True)
class GroupAdvantages:
    """GRPO's advantages ``[N]`` and, for the log, which completions' scaling standard deviation was 0."""

    advantages: Tensor
    zero_std: Tensor


def _check_groups(rewards: Tensor, num_generations: int) -> None:
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [completions], got shape {tuple(rewards.shape)}.")
    if num_generations < 2 or rewards.numel() % num_generations:
        raise ValueError(
            f"{rewards.numel()} rewards cannot form groups of num_generations={num_generations} (at least 2, "
            "dividing the number of completions)."
        )


def group_relative_advantages(rewards: Tensor, num_generations: int, scale_rewards: ScaleRewards) -> GroupAdvantages:
    """GRPO's advantages: each reward minus its group's mean, divided by a standard deviation plus ``1e-4``.

    Args:
        rewards: ``[N]`` combined rewards (:func:`combine_rewards`) of the whole generation batch, every rank's.
        num_generations: completions per prompt (``G``); groups are ``G`` adjacent completions.
        scale_rewards: ``group``: the group's standard deviation; ``batch``: the whole batch's; ``none``: no
            division (Dr. GRPO).

    Standard deviations are NaN-aware with Bessel's correction (:func:`nanstd`); a group of equal rewards gets
    advantage 0 and is flagged in ``zero_std`` (under ``none``, the group's standard deviation is still what
    ``zero_std`` reports, as in TRL).
    """
    _check_groups(rewards, num_generations)
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards must be one of {SCALE_REWARDS}, got {scale_rewards!r}.")
    grouped = rewards.view(-1, num_generations)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(num_generations)
    if scale_rewards == "batch":
        std = nanstd(rewards).expand_as(rewards)
    else:
        std = nanstd(grouped, dim=1).repeat_interleave(num_generations)
    advantages = rewards - mean
    if scale_rewards != "none":
        advantages = advantages / (std + _STD_EPSILON)
    zero_std = torch.isclose(std, torch.zeros_like(std))
    return GroupAdvantages(torch.nan_to_num(advantages, nan=0.0), zero_std)


def normalize_then_sum_advantages(
    rewards_per_function: Tensor, weights: Tensor, num_generations: int
) -> GroupAdvantages:
    """GRPO's advantages with TRL's ``multi_objective_aggregation="normalize_then_sum"`` (GDPO): each function's
    rewards are z-scored within their group (``(r - mean) / (std + 1e-4)``), the weighted sum of those is z-scored
    over the whole batch. ``scale_rewards`` plays no part, as in TRL.

    Args:
        rewards_per_function: ``[N, K]`` every rank's rewards, NaN where a function left a completion unscored (it
            then adds 0 to the sum; a completion no function scored gets advantage 0).
        weights: ``[K]`` one per function.
        num_generations: completions per prompt; groups are ``G`` adjacent completions.
    """
    if rewards_per_function.dim() != 2 or weights.shape != (rewards_per_function.shape[1],):
        raise ValueError(
            f"rewards_per_function must be [completions, functions] and weights [functions], got "
            f"{tuple(rewards_per_function.shape)} and {tuple(weights.shape)}."
        )
    _check_groups(rewards_per_function[:, 0], num_generations)
    grouped = rewards_per_function.view(-1, num_generations, rewards_per_function.shape[1])
    mean = torch.nanmean(grouped, dim=1, keepdim=True)
    normalized = ((grouped - mean) / (nanstd(grouped, dim=1, keepdim=True) + _STD_EPSILON)).flatten(0, 1)
    rewards = (normalized * weights.to(normalized).unsqueeze(0)).nansum(dim=1)
    rewards = rewards.masked_fill(torch.isnan(rewards_per_function).all(dim=1), float("nan"))
    std = nanstd(rewards).expand_as(rewards)
    advantages = (rewards - torch.nanmean(rewards)) / (std + _STD_EPSILON)
    return GroupAdvantages(torch.nan_to_num(advantages, nan=0.0), torch.isclose(std, torch.zeros_like(std)))


def leave_one_out_advantages(rewards: Tensor, num_generations: int, normalize: bool = False) -> Tensor:
    """RLOO's advantages: each reward minus the mean of the other scored rewards of its group.

    Args:
        rewards: ``[N]`` rewards of the whole generation batch (already including RLOO's KL penalty, if any).
        num_generations: completions per prompt; groups are ``G`` adjacent completions.
        normalize: then z-score the advantages over the batch (TRL's ``normalize_advantages``).

    A group with a single scored completion, and unscored completions, get advantage 0.
    """
    _check_groups(rewards, num_generations)
    grouped = rewards.view(-1, num_generations)
    scored = (~torch.isnan(grouped)).sum(dim=1, keepdim=True)
    baseline = (torch.nansum(grouped, dim=1, keepdim=True) - grouped) / (scored - 1)
    advantages = rewards - baseline.view(-1)
    if normalize:
        advantages = (advantages - torch.nanmean(advantages)) / (nanstd(advantages) + _STD_EPSILON)
    return torch.nan_to_num(advantages, nan=0.0)
