"""The RL math as pure functions, against values computed by hand: advantages (group, batch, none; leave-one-out),
unscored completions, and the clipped losses (TRL's own code is compared in test_grpo_trl.py)."""

from __future__ import annotations

import math

import pytest
import torch

from lit_memtrain.objectives.advantages import (
    combine_rewards,
    group_relative_advantages,
    leave_one_out_advantages,
    nanstd,
)
from lit_memtrain.objectives.policy_loss import clipped_policy_loss, k3_kl, rloo_policy_loss

NAN = float("nan")


def test_nanstd_is_bessel_corrected_and_ignores_nan():
    values = torch.tensor([1.0, 2.0, 4.0, NAN])
    assert nanstd(values) == pytest.approx(torch.tensor([1.0, 2.0, 4.0]).std().item())
    assert torch.isnan(nanstd(torch.tensor([3.0, NAN])))  # one value: no spread to estimate
    rows = nanstd(torch.tensor([[1.0, 3.0], [2.0, 2.0]]), dim=1)
    assert rows.tolist() == pytest.approx([math.sqrt(2), 0.0])


def test_combined_rewards_weight_each_function_and_keep_unscored_completions_apart():
    per_function = torch.tensor([[1.0, 2.0], [NAN, 2.0], [NAN, NAN]])
    combined = combine_rewards(per_function, torch.tensor([1.0, 0.5]))
    assert combined[:2].tolist() == [2.0, 1.0] and torch.isnan(combined[2])


def test_equal_rewards_give_zero_advantages_not_nan():
    out = group_relative_advantages(torch.tensor([1.0, 1.0, 0.0, 2.0]), 2, "group")
    assert out.advantages[:2].tolist() == [0.0, 0.0] and out.zero_std.tolist() == [True, True, False, False]
    assert out.advantages[2:].tolist() == pytest.approx([-1 / (math.sqrt(2) + 1e-4), 1 / (math.sqrt(2) + 1e-4)])


def test_group_batch_and_unscaled_advantages():
    rewards = torch.tensor([0.0, 1.0, 2.0, 3.0, 4.0, 8.0])  # group means 1 and 5, standard deviations 1 and sqrt(7)
    deviations = [-1.0, 0.0, 1.0, -2.0, -1.0, 3.0]
    group = group_relative_advantages(rewards, 3, "group").advantages
    stds = [1.0] * 3 + [math.sqrt(7)] * 3
    assert group.tolist() == pytest.approx([d / (s + 1e-4) for d, s in zip(deviations, stds)])
    batch = group_relative_advantages(rewards, 3, "batch").advantages
    batch_std = rewards.std().item()  # the whole batch's, Bessel-corrected
    assert batch.tolist() == pytest.approx([d / (batch_std + 1e-4) for d in deviations])
    assert group_relative_advantages(rewards, 3, "none").advantages.tolist() == pytest.approx(deviations)


def test_unscored_completions_leave_the_group_statistics_and_get_zero_advantage():
    out = group_relative_advantages(torch.tensor([1.0, NAN, 3.0, NAN, 5.0, NAN]), 3, "none")
    assert out.advantages.tolist() == [-1.0, 0.0, 1.0, 0.0, 0.0, 0.0]  # the second group has one scored: no spread
    scaled = group_relative_advantages(torch.tensor([1.0, NAN, 3.0, NAN, NAN, NAN]), 3, "group").advantages
    assert scaled.tolist() == pytest.approx([-1 / (math.sqrt(2) + 1e-4), 0.0, 1 / (math.sqrt(2) + 1e-4), 0, 0, 0])


def test_leave_one_out_baseline():
    advantages = leave_one_out_advantages(torch.tensor([1.0, 2.0, 6.0, 4.0, 4.0, 4.0]), 3)
    assert advantages.tolist() == pytest.approx([1 - 4, 2 - 3.5, 6 - 1.5, 0, 0, 0])
    with_unscored = leave_one_out_advantages(torch.tensor([1.0, NAN, 3.0, 5.0]), 2)
    assert with_unscored.tolist() == [0.0, 0.0, -2.0, 2.0]  # a group with one scored completion: no baseline
    normalized = leave_one_out_advantages(torch.tensor([1.0, 3.0, 2.0, 8.0]), 2, normalize=True)
    raw = torch.tensor([-2.0, 2.0, -6.0, 6.0])
    assert normalized.tolist() == pytest.approx(((raw - raw.mean()) / (raw.std() + 1e-4)).tolist())


def test_groups_must_fit_the_batch():
    with pytest.raises(ValueError, match="num_generations=4"):
        group_relative_advantages(torch.zeros(6), 4, "group")
    with pytest.raises(ValueError, match="num_generations=1"):
        leave_one_out_advantages(torch.zeros(4), 1)
    with pytest.raises(ValueError, match="scale_rewards"):
        group_relative_advantages(torch.zeros(4), 2, "rank")


def test_on_policy_grpo_loss_is_the_policy_gradient():
    logps = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    advantages = torch.tensor([2.0, -1.0])
    out = clipped_policy_loss(logps, None, advantages, mask, loss_type="grpo", epsilon_low=0.2, epsilon_high=0.2)
    assert out.loss.item() == pytest.approx(-(2.0 - 1.0) / 2)  # ratio 1: -mean over completions of A
    out.loss.backward()
    torch.testing.assert_close(logps.grad, torch.tensor([[-0.5, -0.5, 0.0], [0.5, 0.0, 0.0]]))  # -A / length / B


def test_clipping_binds_only_in_the_direction_that_helps():
    logps = torch.zeros(1, 4, requires_grad=True)
    old = torch.log(torch.tensor([[0.5, 2.0, 0.5, 2.0]]))  # ratios 2.0, 0.5, 2.0, 0.5
    mask = torch.ones(1, 4)
    for advantage, low, high in [(1.0, [False] * 4, [True, False, True, False]),
                                 (-1.0, [False, True, False, True], [False] * 4)]:
        out = clipped_policy_loss(logps, old, torch.tensor([advantage]), mask, loss_type="bnpo", epsilon_low=0.2,
                                  epsilon_high=0.28)
        assert out.low_clipped[0].tolist() == low and out.high_clipped[0].tolist() == high


def test_loss_normalisers():
    logps = torch.zeros(2, 3, requires_grad=True)
    old = torch.zeros(2, 3)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    advantages = torch.tensor([1.0, 1.0])

    def loss(loss_type, **kwargs):
        return clipped_policy_loss(logps, old, advantages, mask, loss_type=loss_type, epsilon_low=0.2,
                                   epsilon_high=0.2, **kwargs).loss.item()

    assert loss("bnpo", accumulation_steps=2) == pytest.approx(-1 / 2)
    assert loss("dr_grpo", max_completion_length=8) == pytest.approx(-4 / (2 * 8))
    assert loss("dapo", dapo_normalizer=10.0) == pytest.approx(-4 / 10)
    with pytest.raises(ValueError, match="max_completion_length"):
        loss("dr_grpo")
    with pytest.raises(ValueError, match="dapo_normalizer"):
        loss("dapo")
    with pytest.raises(ValueError, match="ref_logps"):
        loss("grpo", beta=0.1)


def test_k3_kl_is_zero_at_the_reference_and_positive_elsewhere():
    logps = torch.tensor([-1.0, -1.0, -3.0])
    kl = k3_kl(logps, torch.tensor([-1.0, -2.0, -1.0]))
    assert kl[0] == 0 and (kl[1:] > 0).all()
    assert kl[1].item() == pytest.approx(math.exp(-1) + 1 - 1)


def test_rloo_loss_has_one_ratio_per_completion():
    logps = torch.tensor([[-1.0, -1.0], [-2.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    old = torch.tensor([-2.5, -2.0])  # ratios e^0.5 (clipped at 1.2 for A > 0) and 1
    out = rloo_policy_loss(logps, old, torch.tensor([1.0, -1.0]), mask, epsilon_low=0.2, epsilon_high=0.2)
    assert out.loss.item() == pytest.approx(-(1.2 - 1.0) / 2)
    assert out.high_clipped.tolist() == [True, False]
    out.loss.backward()
    torch.testing.assert_close(logps.grad, torch.tensor([[0.0, 0.0], [0.5, 0.0]]))  # none through the clipped one


def test_every_rank_values_cuts_each_ranks_padding_off():
    """The high-entropy mask's quantile is over every rank's tokens, which differ in number: the gather pads to the
    longest and keeps each rank's own count (a fake all_gather for rank 0 of 2, the other holding 3 values)."""
    from lit_memtrain.objectives.ragged_gather import every_rank_values

    mine, other = torch.tensor([0.5, 2.0]), torch.tensor([1.0, 3.0, 4.0])

    def all_gather(tensor):
        if tensor.dim() == 0:
            return torch.tensor([mine.numel(), other.numel()])
        assert tensor.numel() == 3 and tensor[: mine.numel()].equal(mine)  # padded to the longest
        return torch.stack([tensor, other])

    assert every_rank_values(mine, all_gather, 2).tolist() == [0.5, 2.0, 1.0, 3.0, 4.0]
    assert every_rank_values(mine, all_gather, 1) is mine
