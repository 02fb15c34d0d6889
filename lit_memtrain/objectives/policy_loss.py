"""The clipped policy-gradient losses of GRPO (and its DAPO, Dr. GRPO, BNPO variants) and RLOO, as TRL computes them.

Why plain functions on ``[B, T]`` tensors: TRL 1.16's ``GRPOTrainer._compute_loss`` and ``RLOOTrainer._compute_loss``
work on right-padded completions (``B`` completions of up to ``T`` tokens, ``mask`` 1 on trained tokens). Keeping
the same layout here makes each formula a line-by-line match of TRL's, checked against TRL itself in tests; the
module computes the log-probabilities padding-free and scatters them into this layout.

Per token, with ``rho = exp(logp - logp_old)`` and the completion's advantage ``A``:
``l = -min(rho * A, clip(rho, 1 - epsilon_low, 1 + epsilon_high) * A) + beta * KL``, where ``KL`` is the k3
estimate ``exp(ref - logp) - (ref - logp) - 1``, times ``rho`` with ``bias_correction_kl`` (TRL's
``use_bias_correction_kl``). How the token losses of a micro-batch become its loss is the ``loss_type``:

========= ======================================================================================================
grpo      mean over completions of ``sum(m * l) / max(1, sum(m))``, divided by the gradient accumulation steps
bnpo      ``sum(m * l) / max(1, sum(m))`` over the micro-batch, divided by the gradient accumulation steps
dr_grpo   ``sum(m * l) / (B * max_completion_length)``, divided by the gradient accumulation steps
dapo      ``sum(m * l) / normalizer``: the generation batch's trained tokens (all ranks), scaled so that one optimizer
          step is the mean over every token it trains (TRL's default)
========= ======================================================================================================

RLOO's loss is per completion: ``rho = exp(sum(m * logp) - sum(m * logp_old))`` clipped the same way, averaged over
the micro-batch's completions and divided by the gradient accumulation steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

__all__ = [
    "LOSS_TYPES",
    "PolicyLoss",
    "PolicyLossType",
    "clipped_policy_loss",
    "k3_kl",
    "rloo_policy_loss",
]

PolicyLossType = Literal["grpo", "dr_grpo", "dapo", "bnpo"]
LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo")


@dataclass(frozen=True)
class PolicyLoss:
    """A micro-batch's loss and what TRL logs about it.

    Attributes:
        loss: the scalar to backpropagate.
        ratio: the importance ratio ``rho``, ``[B, T]`` (GRPO) or ``[B]`` (RLOO).
        low_clipped, high_clipped: where ``rho < 1 - epsilon_low`` with ``A < 0`` / ``rho > 1 + epsilon_high`` with
            ``A > 0`` (the clip binds), shaped like ``ratio``.
        kl: the per-token KL term (before ``beta``), ``[B, T]``; ``None`` without a reference.
        entropy: the policy's entropy at each token, ``[B, T]``, 0 off the mask, where the caller measured it with
            the log-probabilities (no gradient; logged, not trained on).
        router_aux: a mixture-of-experts model's router load-balancing loss of the micro-batch (detached), when
            ``loss`` includes it.
    """

    loss: Tensor
    ratio: Tensor
    low_clipped: Tensor
    high_clipped: Tensor
    kl: Tensor | None = None
    entropy: Tensor | None = None
    router_aux: Tensor | None = None


def k3_kl(logps: Tensor, ref_logps: Tensor) -> Tensor:
    """Schulman's k3 estimate of ``KL(policy || reference)`` per token: ``exp(ref - logp) - (ref - logp) - 1``."""
    delta = ref_logps - logps
    return torch.exp(delta) - delta - 1


def _check_epsilons(epsilon_low: float, epsilon_high: float) -> None:
    if not (0 <= epsilon_low < 1 and epsilon_high >= 0):
        raise ValueError(f"epsilon must be in [0, 1) and epsilon_high >= 0, got {epsilon_low} and {epsilon_high}.")


def _clip_flags(ratio: Tensor, advantages: Tensor, epsilon_low: float, epsilon_high: float) -> tuple[Tensor, Tensor]:
    return (ratio < 1 - epsilon_low) & (advantages < 0), (ratio > 1 + epsilon_high) & (advantages > 0)


def clipped_policy_loss(
    logps: Tensor,
    old_logps: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    *,
    loss_type: PolicyLossType,
    epsilon_low: float,
    epsilon_high: float,
    beta: float = 0.0,
    ref_logps: Tensor | None = None,
    bias_correction_kl: bool = True,
    accumulation_steps: int = 1,
    max_completion_length: int | None = None,
    dapo_normalizer: Tensor | float | None = None,
    importance_weights: Tensor | None = None,
) -> PolicyLoss:
    """GRPO's clipped surrogate loss of one micro-batch (TRL's ``_compute_loss``, token-level importance sampling).

    Args:
        logps: ``[B, T]`` completion tokens' log-probabilities under the policy (with gradients), 0 off ``mask``.
        old_logps: ``[B, T]`` the same under the policy that sampled them; ``None`` when training on-policy: then
            ``logps.detach()``, so ``rho`` is 1 but its gradient is the policy gradient.
        advantages: ``[B]`` one per completion.
        mask: ``[B, T]`` 1 on trained tokens (through the first EOS, not truncated ones when masked), 0 elsewhere.
        loss_type: how token losses are aggregated (see the module docstring).
        epsilon_low, epsilon_high: the clip range ``[1 - epsilon_low, 1 + epsilon_high]``.
        beta, ref_logps: the KL term's weight and the reference's ``[B, T]`` log-probabilities (needed when
            ``beta != 0``).
        bias_correction_kl: multiply the KL term by ``rho`` (TRL's ``use_bias_correction_kl``).
        accumulation_steps: micro-batches per optimizer step (``grpo``, ``bnpo``, ``dr_grpo`` divide by it).
        max_completion_length: ``dr_grpo``'s constant.
        dapo_normalizer: ``dapo``'s divisor (:meth:`~lit_memtrain.objectives.grpo.GRPOModule.loss_normalizer`).
        importance_weights: ``[B, T]`` or ``[B, 1]`` weights of the clipped term (TRL's vLLM importance-sampling
            ratio, :mod:`~lit_memtrain.objectives.sampling_correction`), applied before the KL term is added.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}.")
    _check_epsilons(epsilon_low, epsilon_high)
    if logps.dim() != 2 or mask.shape != logps.shape or advantages.shape != logps.shape[:1]:
        raise ValueError(
            f"logps and mask must be [B, T] and advantages [B], got {tuple(logps.shape)}, {tuple(mask.shape)} and "
            f"{tuple(advantages.shape)}."
        )
    mask = mask.to(logps.dtype)
    old_logps = logps.detach() if old_logps is None else old_logps
    ratio = torch.exp(logps - old_logps)
    column = advantages.unsqueeze(1)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    per_token = -torch.min(ratio * column, clipped * column)
    if importance_weights is not None:
        per_token = per_token * importance_weights
    kl = None
    if beta != 0.0:
        if ref_logps is None:
            raise ValueError("beta != 0 needs the reference's log-probabilities (ref_logps).")
        kl = k3_kl(logps, ref_logps)
        if bias_correction_kl:
            kl = kl * ratio
        per_token = per_token + beta * kl
    masked = per_token * mask
    if loss_type == "grpo":
        loss = (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / accumulation_steps
    elif loss_type == "bnpo":
        loss = masked.sum() / mask.sum().clamp(min=1.0) / accumulation_steps
    elif loss_type == "dr_grpo":
        if not max_completion_length:
            raise ValueError("loss_type='dr_grpo' divides by max_completion_length, which was not given.")
        loss = masked.sum() / (logps.shape[0] * max_completion_length) / accumulation_steps
    else:
        if dapo_normalizer is None:
            raise ValueError("loss_type='dapo' divides by the generation batch's token count (dapo_normalizer).")
        loss = masked.sum() / dapo_normalizer
    low, high = _clip_flags(ratio, column, epsilon_low, epsilon_high)
    return PolicyLoss(loss, ratio.detach(), low, high, None if kl is None else kl.detach())


def rloo_policy_loss(
    logps: Tensor,
    old_sequence_logps: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    *,
    epsilon_low: float,
    epsilon_high: float,
    accumulation_steps: int = 1,
) -> PolicyLoss:
    """RLOO's clipped loss of one micro-batch (TRL's ``RLOOTrainer._compute_loss``): a ratio per completion.

    Args:
        logps, mask: ``[B, T]`` as for :func:`clipped_policy_loss`.
        old_sequence_logps: ``[B]`` each completion's summed log-probability under the sampling policy; ``None``
            on-policy (the current sums, detached).
        advantages: ``[B]``.
        accumulation_steps: the mean over completions is divided by it (as the Hugging Face Trainer does).
    """
    _check_epsilons(epsilon_low, epsilon_high)
    if logps.dim() != 2 or mask.shape != logps.shape or advantages.shape != logps.shape[:1]:
        raise ValueError(
            f"logps and mask must be [B, T] and advantages [B], got {tuple(logps.shape)}, {tuple(mask.shape)} and "
            f"{tuple(advantages.shape)}."
        )
    sequence_logps = (logps * mask.to(logps.dtype)).sum(1)
    old = sequence_logps.detach() if old_sequence_logps is None else old_sequence_logps
    ratio = torch.exp(sequence_logps - old)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    loss = -torch.min(ratio * advantages, clipped * advantages).mean() / accumulation_steps
    low, high = _clip_flags(ratio, advantages, epsilon_low, epsilon_high)
    return PolicyLoss(loss, ratio.detach(), low, high)
