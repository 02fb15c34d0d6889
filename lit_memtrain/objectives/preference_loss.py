"""Preference losses (DPO's sigmoid loss and IPO) from sequence log-probabilities, plain torch.

Why apart from the module: the loss is a function of four vectors of log-probabilities (policy and
reference, chosen and rejected), so it is tested against TRL's formulas without a model, and usable without
Lightning. Conventions follow TRL's ``DPOTrainer``: the implicit reward of a completion is ``beta`` times its
policy-to-reference log-ratio; the sigmoid loss is ``-log sigmoid(chosen reward - rejected reward)``; IPO
squares the gap between the per-token log-ratio margin and ``1 / (2 beta)``, the log-ratios divided by each
completion's token count (as TRL does, after the IPO authors).
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch.nn.functional as F
from torch import Tensor

PreferenceLossType = Literal["sigmoid", "ipo"]
LOSS_TYPES = ("sigmoid", "ipo")


class PreferenceLoss(NamedTuple):
    """Per-pair losses and the implicit rewards (``beta`` times the log-ratios, detached)."""

    losses: Tensor
    chosen_rewards: Tensor
    rejected_rewards: Tensor


def preference_loss(
    chosen_logps: Tensor,
    rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    beta: float,
    loss_type: PreferenceLossType = "sigmoid",
    chosen_tokens: Tensor | None = None,
    rejected_tokens: Tensor | None = None,
) -> PreferenceLoss:
    """Per-pair DPO (``sigmoid``) or IPO losses of ``B`` pairs of completion log-probabilities (each ``[B]``).

    ``chosen_tokens`` / ``rejected_tokens`` (``[B]``, the completions' token counts) are needed by IPO.

    Example:
        >>> out = preference_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta=0.1)  # doctest: +SKIP
        >>> out.losses.mean().backward()  # doctest: +SKIP
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}.")
    chosen_logratios = chosen_logps - ref_chosen_logps.to(chosen_logps)
    rejected_logratios = rejected_logps - ref_rejected_logps.to(rejected_logps)
    if loss_type == "sigmoid":
        losses = -F.logsigmoid(beta * (chosen_logratios - rejected_logratios))
    else:
        if chosen_tokens is None or rejected_tokens is None:
            raise ValueError("loss_type='ipo' needs chosen_tokens and rejected_tokens (each completion's token count).")
        margin = chosen_logratios / chosen_tokens.clamp(min=1) - rejected_logratios / rejected_tokens.clamp(min=1)
        losses = (margin - 1 / (2 * beta)) ** 2
    return PreferenceLoss(losses, beta * chosen_logratios.detach(), beta * rejected_logratios.detach())
