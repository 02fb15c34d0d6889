"""The policy-gradient losses of GRPO (TRL 1.16's ``loss_type`` variants) and RLOO, as TRL computes them.

Why plain functions on ``[B, T]`` tensors: TRL 1.16's ``GRPOTrainer._compute_loss`` and ``RLOOTrainer._compute_loss``
work on right-padded completions (``B`` completions of up to ``T`` tokens, ``mask`` 1 on trained tokens). Keeping
the same layout here makes each formula a line-by-line match of TRL's, checked against TRL itself in tests; the
module computes the log-probabilities padding-free and scatters them into this layout.

The importance weight ``rho`` is ``exp(logp - logp_old)`` per token, or with ``importance_sampling_level="sequence"``
(GSPO) one per completion, ``exp(mean_t(logp - logp_old))``. With the completion's advantage ``A``, per token:

========= ======================================================================================================
clipped   ``l = -min(rho' A, clip(rho, 1 - epsilon_low, 1 + epsilon_high) A)``, ``rho' = min(rho, delta)`` with
          ``delta`` (two-sided clipping), else ``rho``: ``grpo``, ``bnpo``, ``dr_grpo``, ``dapo``, ``luspo``
cispo     ``l = -sg(min(rho, epsilon_high)) A logp`` (``sg``: no gradient; ``epsilon_high`` is CISPO's bound)
sapo      ``l = -sigmoid(tau (rho - 1)) 4 / tau A``, ``tau`` = ``sapo_temperature_pos`` if ``A > 0`` else ``_neg``
vespo     ``l = -sg(phi(w)) A logp``, ``phi(w) = exp(lambda + k log w - lambda w)`` of the completion's summed ratio
          ``w`` (``k``, ``lambda``: ``vespo_k_pos`` / ``vespo_lambda_pos`` if ``A >= 0``, else ``_neg``)
========= ======================================================================================================

then ``l`` is multiplied by the off-policy sequence mask (``off_policy_mask_threshold``: a completion with ``A < 0``
whose mean ``logp_sampling - logp`` exceeds the threshold is dropped; ``logp_sampling`` the engine's, vLLM's, where
it reported them, else ``logp_old``) and the high-entropy token mask
(``top_entropy_quantile``), and ``beta * KL`` is added, ``KL`` the k3 estimate ``exp(ref - logp) - (ref - logp) - 1``,
times ``rho`` with ``bias_correction_kl``. How the token losses of a micro-batch become its loss:

============== =================================================================================================
grpo, sapo     mean over completions of ``sum(m * l) / max(1, sum(m))``, divided by the gradient accumulation steps
bnpo           ``sum(m * l) / max(1, sum(m))`` over the micro-batch, divided by the gradient accumulation steps
dr_grpo        ``sum(m * l) / (B * max_completion_length)``, divided by the gradient accumulation steps
luspo          mean over completions of ``sum(m * l)``, divided by the gradient accumulation steps
dapo, cispo,   ``sum(m * l) / normalizer``: the generation batch's trained tokens (all ranks), scaled so that one
vespo          optimizer step is the mean over every token it trains (TRL's default)
============== =================================================================================================

The entropy bonus (``entropy_coef``) subtracts ``coef * mean(H)`` over the trained (and high-entropy) tokens, divided
by the gradient accumulation steps, whatever the loss type.

RLOO's loss is per completion: ``rho = exp(sum(m * logp) - sum(m * logp_old))`` clipped the same way, averaged over
the micro-batch's completions and divided by the gradient accumulation steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import math

import torch
from torch import Tensor

from lit_memtrain.objectives.grpo_options import PolicyLossOptions

__all__ = [
    "LOSS_TYPES",
    "PolicyLoss",
    "PolicyLossType",
    "clipped_policy_loss",
    "high_entropy_mask",
    "k3_kl",
    "off_policy_mask",
    "rloo_policy_loss",
    "vespo_gamma_weights",
]

PolicyLossType = Literal["grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo"]
LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo")
CLIPPED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")  # the min(rho A, clip(rho) A) family


@dataclass(frozen=True)
class PolicyLoss:
    """A micro-batch's loss and what TRL logs about it.

    Attributes:
        loss: the scalar to backpropagate.
        ratio: the importance weight ``rho``, ``[B, T]`` (per token) or ``[B]`` (per completion: GSPO, RLOO).
        low_clipped, high_clipped: where ``rho < 1 - epsilon_low`` with ``A < 0`` / ``rho > 1 + epsilon_high`` with
            ``A > 0`` (the clip binds), shaped like ``ratio``; ``None`` for the losses without that clip (cispo,
            sapo, vespo), for which TRL logs no ``clip_ratio``.
        kl: the per-token KL term (before ``beta``), ``[B, T]``; ``None`` without a reference.
        entropy: the policy's entropy at each token, ``[B, T]``, 0 off the mask, where the caller measured it with
            the log-probabilities (detached: for the log).
        policy_loss: ``loss`` without the entropy bonus (detached), when a bonus was added (TRL logs it).
        means: what else TRL logs as a mean over the trained tokens (``[B, T]`` values) or the completions (``[B]``),
            by TRL's name: ``cispo_clip_ratio``, ``vespo/phi_seq_mean``.
        router_aux: a mixture-of-experts model's router load-balancing loss of the micro-batch (detached), when
            ``loss`` includes it.
    """

    loss: Tensor
    ratio: Tensor
    low_clipped: Tensor | None
    high_clipped: Tensor | None
    kl: Tensor | None = None
    entropy: Tensor | None = None
    policy_loss: Tensor | None = None
    means: dict[str, Tensor] = field(default_factory=dict)
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


def off_policy_mask(
    advantages: Tensor, logps: Tensor, sampling_logps: Tensor, mask: Tensor, threshold: float
) -> Tensor:
    """TRL's off-policy sequence mask (DeepSeek-V3.2), ``[B, 1]``: 1 keeps a completion, 0 drops it. A completion
    is dropped when its advantage is negative and its mean ``sampling_logps - logps`` over the trained tokens (a
    forward KL estimate; NaN counts as 0) exceeds ``threshold``."""
    kl = torch.nan_to_num(sampling_logps - logps.detach(), nan=0.0)
    mean_kl = (kl * mask).sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1.0)
    return ((advantages >= 0) | (mean_kl <= threshold)).to(mask.dtype)


def high_entropy_mask(
    entropies: Tensor, mask: Tensor, top_quantile: float, every_rank_entropies: Tensor | None = None
) -> Tensor:
    """``[B, T]`` bool: the trained tokens whose entropy is at least the ``1 - top_quantile`` quantile of the trained
    tokens' entropies (TRL's ``top_entropy_quantile``: 0.2 keeps the top 20 %); over ``every_rank_entropies``
    (every rank's trained tokens' entropies, 1-D) when given, else this micro-batch's."""
    values = entropies.detach()[mask.bool()].float() if every_rank_entropies is None else every_rank_entropies
    if values.numel() == 0:
        return torch.zeros_like(entropies, dtype=torch.bool)
    threshold = torch.quantile(values, 1 - top_quantile)
    return ((entropies.detach() * mask.float()) >= threshold) & mask.bool()


@torch.no_grad()
def vespo_gamma_weights(
    advantages: Tensor, log_ratio: Tensor, mask: Tensor, k_pos: float, lambda_pos: float, k_neg: float,
    lambda_neg: float, importance_weights: Tensor | None = None,
) -> Tensor:  # fmt: skip
    """VESPO's ``[B, 1]`` weights ``phi(w) = exp(lambda + k log w - lambda w)`` (1 at ``w = 1``) of each completion's
    importance weight ``w = exp(sum_t clamp(log_ratio, -20, 20))``, ``log w`` clamped to ``[log 1e-8, 20]``, as TRL's
    ``get_gamma_weights``; vLLM's importance-sampling ratio (``importance_weights``, ``[B, T]`` or ``[B, 1]``), when
    given, joins ``w`` there (its log clamped to ``[log 1e-8, 20]``), as in TRL. No gradient: a per-completion scale."""
    lower = math.log(1e-8)
    log_w = (torch.clamp(log_ratio, -20.0, 20.0) * mask).sum(dim=-1, keepdim=True)
    if importance_weights is not None:
        log_is = torch.clamp(torch.log(importance_weights), lower, 20.0)
        log_w = log_w + (log_is * mask if log_is.shape == mask.shape else log_is).sum(dim=-1, keepdim=True)
    log_w = log_w.clamp(lower, 20.0)
    nonnegative = advantages >= 0
    k = torch.where(nonnegative, k_pos, k_neg)
    lam = torch.where(nonnegative, lambda_pos, lambda_neg).clamp(min=1e-4)
    return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


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
    options: PolicyLossOptions | None = None,
    entropy_mask: Tensor | None = None,
    entropies: Tensor | None = None,
    entropy_coef: float | None = None,
    importance_weights: Tensor | None = None,
    sampling_logps: Tensor | None = None,
) -> PolicyLoss:
    """GRPO's policy loss of one micro-batch: TRL's ``_compute_loss`` (see the module docstring for each variant).

    Args:
        logps: ``[B, T]`` completion tokens' log-probabilities under the policy (with gradients), 0 off ``mask``.
        old_logps: ``[B, T]`` the same under the policy that sampled them; ``None`` when training on-policy: then
            ``logps.detach()``, so ``rho`` is 1 but its gradient is the policy gradient.
        advantages: ``[B]`` one per completion.
        mask: ``[B, T]`` 1 on trained tokens (through the first EOS, not truncated ones when masked), 0 elsewhere.
        loss_type: TRL's ``loss_type``: the per-token loss and how it is aggregated (module docstring).
        epsilon_low, epsilon_high: the clip range ``[1 - epsilon_low, 1 + epsilon_high]``; cispo's upper bound is
            ``epsilon_high`` itself.
        beta, ref_logps: the KL term's weight and the reference's ``[B, T]`` log-probabilities (needed when
            ``beta != 0``).
        bias_correction_kl: multiply the KL term by ``rho`` (TRL's ``use_bias_correction_kl``).
        accumulation_steps: micro-batches per optimizer step (all but ``dapo``, ``cispo``, ``vespo`` divide by it).
        max_completion_length: ``dr_grpo``'s constant.
        dapo_normalizer: the divisor of ``dapo``, ``cispo``, ``vespo``
            (:meth:`~lit_memtrain.objectives.grpo.GRPOModule.loss_normalizer`).
        options: TRL's ``importance_sampling_level`` (``sequence``: GSPO), ``delta`` (two-sided clipping), the
            ``sapo`` / ``vespo`` parameters and ``off_policy_mask_threshold`` (:func:`off_policy_mask`); None: TRL's
            defaults. Its entropy fields are the caller's (``entropy_mask``, ``entropy_coef``).
        entropy_mask: ``[B, T]`` the tokens the policy term trains (:func:`high_entropy_mask`); None: all.
        entropies: ``[B, T]`` the policy's entropy per token, with gradient: needed by the entropy bonus.
        entropy_coef: the entropy bonus's coefficient for this micro-batch; None: no bonus (0.0 is a bonus of 0,
            logged as one).
        importance_weights: ``[B, T]`` or ``[B, 1]`` weights of the policy term (TRL's vLLM importance-sampling
            ratio, :mod:`~lit_memtrain.objectives.sampling_correction`), applied before the KL term is added; for
            ``vespo``, part of its weights ``phi`` instead, as TRL.
        sampling_logps: ``[B, T]`` the log-probabilities the generation engine sampled with (vLLM's; NaN where it
            gave none), when it reported them: the off-policy mask measures the drift from those (the engine's
            mismatch with the trainer and the updates since), as TRL's; else from ``old_logps``.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}.")
    options = PolicyLossOptions() if options is None else options
    sequence_level = options.importance_sampling_level == "sequence"
    _check_epsilons(epsilon_low, epsilon_high)
    if logps.dim() != 2 or mask.shape != logps.shape or advantages.shape != logps.shape[:1]:
        raise ValueError(
            f"logps and mask must be [B, T] and advantages [B], got {tuple(logps.shape)}, {tuple(mask.shape)} and "
            f"{tuple(advantages.shape)}."
        )
    if entropy_coef is not None and entropies is None:
        raise ValueError("The entropy bonus (entropy_coef) needs the policy's entropies with their gradient.")
    mask = mask.to(logps.dtype)
    old_logps = logps.detach() if old_logps is None else old_logps
    column = advantages.unsqueeze(1)
    log_ratio = logps - old_logps
    if sequence_level:  # [B, 1]: broadcast over the tokens below
        ratio = torch.exp(((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1))
    else:
        ratio = torch.exp(log_ratio)
    kl = None
    if beta != 0.0:
        if ref_logps is None:
            raise ValueError("beta != 0 needs the reference's log-probabilities (ref_logps).")
        kl = k3_kl(logps, ref_logps)
        if bias_correction_kl:
            kl = kl * ratio
    low = high = None
    means: dict[str, Tensor] = {}
    if loss_type == "cispo":
        per_token = -torch.clamp(ratio, max=epsilon_high).detach() * column * logps
        means["cispo_clip_ratio"] = ((ratio > epsilon_high) & (column > 0)).float().detach()
    elif loss_type in CLIPPED_LOSS_TYPES:
        clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
        weight = ratio if options.delta is None else torch.clamp(ratio, max=options.delta)
        per_token = -torch.min(weight * column, clipped * column)
        low, high = _clip_flags(weight.detach(), column, epsilon_low, epsilon_high)  # TRL flags the capped weight
    elif loss_type == "sapo":
        temperatures = torch.where(column > 0, options.sapo_temperature_pos, options.sapo_temperature_neg)
        per_token = -(torch.sigmoid(temperatures * (ratio - 1)) * 4 / temperatures) * column
    else:  # vespo
        phi = vespo_gamma_weights(column, log_ratio, mask, options.vespo_k_pos, options.vespo_lambda_pos,
                                  options.vespo_k_neg, options.vespo_lambda_neg, importance_weights)  # fmt: skip
        per_token = -phi * column * logps
        means["vespo/phi_seq_mean"] = phi.squeeze(1)  # one per completion, as TRL counts it
    if options.off_policy_mask_threshold is not None:
        drifted_from = old_logps if sampling_logps is None else sampling_logps
        per_token = per_token * off_policy_mask(column, logps, drifted_from, mask, options.off_policy_mask_threshold)
    if entropy_mask is not None:
        per_token = per_token * entropy_mask
    if importance_weights is not None and loss_type != "vespo":  # vLLM's ratio (vespo's is in phi), before the KL
        per_token = per_token * importance_weights
    if kl is not None:
        per_token = per_token + beta * kl
    loss = _aggregate(per_token * mask, mask, loss_type, accumulation_steps, max_completion_length, dapo_normalizer)
    policy_loss = None
    if entropy_coef is not None:
        effective = mask if entropy_mask is None else mask * entropy_mask
        entropy_term = (entropies * effective).sum() / effective.sum().clamp(min=1.0) / accumulation_steps
        policy_loss = loss.detach()
        loss = loss - entropy_coef * entropy_term
    if sequence_level:  # one value per completion, as TRL logs them
        ratio, low, high = ratio.squeeze(1), _squeeze(low), _squeeze(high)
        means = {name: value.squeeze(1) if value.dim() == 2 else value for name, value in means.items()}
    kl = None if kl is None else kl.detach()
    return PolicyLoss(loss, ratio.detach(), low, high, kl, policy_loss=policy_loss, means=means)


def _squeeze(flags: Tensor | None) -> Tensor | None:
    return None if flags is None else flags.squeeze(1)


def _aggregate(
    masked: Tensor,
    mask: Tensor,
    loss_type: PolicyLossType,
    accumulation_steps: int,
    max_completion_length: int | None,
    dapo_normalizer: Tensor | float | None,
) -> Tensor:
    """The micro-batch's loss from its masked token losses ``[B, T]``, as ``loss_type`` aggregates them."""
    if loss_type in ("grpo", "sapo"):
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / accumulation_steps
    if loss_type == "bnpo":
        return masked.sum() / mask.sum().clamp(min=1.0) / accumulation_steps
    if loss_type == "dr_grpo":
        if not max_completion_length:
            raise ValueError("loss_type='dr_grpo' divides by max_completion_length, which was not given.")
        return masked.sum() / (masked.shape[0] * max_completion_length) / accumulation_steps
    if loss_type == "luspo":
        return masked.sum(-1).mean() / accumulation_steps
    if dapo_normalizer is None:
        raise ValueError(f"loss_type={loss_type!r} divides by the generation batch's token count (dapo_normalizer).")
    return masked.sum() / dapo_normalizer


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
