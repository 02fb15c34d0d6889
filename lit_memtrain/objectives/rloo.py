"""RLOOModule: REINFORCE Leave-One-Out (TRL's ``RLOOTrainer``), GRPOModule's step with RLOO's baseline and loss.

Why a subclass rather than an option: RLOO differs from GRPO in three places only, each an override here, and
its defaults differ (TRL's ``RLOOConfig``: 2 generations, ``beta`` 0.05); an option would leave GRPO's
``policy_loss`` / ``scale_rewards`` meaningless under it.

- **Baseline**: each completion's advantage is its reward minus the mean reward of the other completions of its
  prompt (:func:`~lit_memtrain.objectives.advantages.leave_one_out_advantages`), optionally z-scored over the batch.
- **KL**: a penalty on the reward, not a loss term: ``r - beta * sum_t (logp_old - logp_ref)`` over the completion
  (the k1 estimate, which can be negative), so the sampling policy's log-probabilities are computed whenever
  ``beta != 0``.
- **Loss**: one importance ratio per completion, ``exp(sum_t logp - sum_t logp_old)``, clipped, averaged over the
  micro-batch's completions (:func:`~lit_memtrain.objectives.policy_loss.rloo_policy_loss`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from lit_memtrain.objectives.advantages import combine_rewards, leave_one_out_advantages, nanstd
from lit_memtrain.objectives.grpo import GRPOModule
from lit_memtrain.objectives.policy_loss import PolicyLoss, rloo_policy_loss
from lit_memtrain.objectives.rollout import Rollout

__all__ = ["RLOOModule"]

# GRPOConfig's, not RLOOConfig's (TRL 1.16): the loss variants, token controls, entropy bonus, fp32 head and vLLM
# importance-sampling correction are GRPO's.
_GRPO_ONLY = ("policy_loss", "scale_rewards", "use_bias_correction_kl", "importance_sampling_level", "delta",
              "sapo_temperature_pos", "sapo_temperature_neg", "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg",
              "vespo_lambda_neg", "off_policy_mask_threshold", "top_entropy_quantile", "entropy_coef",
              "use_adaptive_entropy", "entropy_coef_min", "entropy_coef_max", "entropy_coef_delta", "entropy_target",
              "multi_objective_aggregation", "cast_lm_head_to_fp32", "vllm_importance_sampling_correction",
              "vllm_importance_sampling_mode", "vllm_importance_sampling_clip_max",
              "vllm_importance_sampling_clip_min")  # fmt: skip


class RLOOModule(GRPOModule):
    """Train a causal LM with RLOO on prompts, from the rewards of its own completions.

    Args:
        reward_funcs, reward_weights: as for :class:`~lit_memtrain.objectives.grpo.GRPOModule`.
        num_generations: completions per prompt (TRL's RLOO default: 2).
        beta: weight of the KL penalty on the reward (TRL's RLOO default: 0.05; 0: no reference).
        normalize_advantages: z-score the advantages over the generation batch.
        reward_clip_range: clip each combined reward to ``(min, max)`` before the baseline (None: no clipping).
        **kwargs: every other argument of :class:`~lit_memtrain.objectives.grpo.GRPOModule` (sampling, epsilon,
            num_iterations, steps_per_generation, mask_truncated_completions, model and optimizer options), but
            GRPO's ``policy_loss``, ``scale_rewards``, ``use_bias_correction_kl`` and its loss variants and token
            controls (``importance_sampling_level``, ``delta``, ``entropy_coef``, ...), which TRL's RLOO has
            not, ``cast_lm_head_to_fp32`` and ``vllm_importance_sampling_*`` (TRL's ``RLOOConfig`` has neither).

    Logged: as GRPOModule, with ``kl`` the mean over completion tokens of ``logp_old - logp_ref`` (``beta != 0``)
    and the clip ratios counted per completion.

    Example:
        >>> module = RLOOModule(preset="tiny-qwen3", tokenizer="lit-memtrain/embedded", reward_funcs=[accuracy])
        >>> Trainer(max_steps=20).fit(module, datamodule=PromptDataModule(batch_size=4))  # doctest: +SKIP
    """

    def __init__(
        self,
        reward_funcs: Sequence[str | Callable[..., Any]] | str | Callable[..., Any],
        num_generations: int = 2,
        beta: float = 0.05,
        normalize_advantages: bool = False,
        reward_clip_range: tuple[float, float] | None = None,
        **kwargs: Any,
    ) -> None:
        given = [name for name in _GRPO_ONLY if name in kwargs]
        if given:
            raise ValueError(
                f"{given} are GRPOModule's (TRL's GRPOConfig has them, its RLOOConfig does not); RLOO has a loss and a "
                "baseline of its own. Leave them out, or train with GRPOModule."
            )
        if reward_clip_range is not None:
            low, high = reward_clip_range
            if not low < high:
                raise ValueError(f"reward_clip_range must be (min, max) with min < max, got {reward_clip_range}.")
        super().__init__(reward_funcs, num_generations=num_generations, beta=beta, **kwargs)
        for name in _GRPO_ONLY:  # GRPO's defaults, which RLOO does not read: not saved as RLOO's settings
            del self.hparams[name]
        self.sampling_correction = None  # TRL's RLOOTrainer has no vLLM importance-sampling correction
        self.reward_clip_range = None if reward_clip_range is None else tuple(reward_clip_range)

    @property
    def needs_old_logps(self) -> bool:
        """Off-policy, as GRPO; and whenever ``beta != 0``: the KL penalty compares them with the reference's."""
        return self.off_policy or self.hparams.beta != 0

    def compute_advantages(self, rewards_per_function: Tensor, rollout: Rollout) -> tuple[Tensor, dict[str, Tensor]]:
        """RLOO's advantages of the whole generation batch ``[world * N]`` from its rewards ``[world * N, K]``."""
        weights = self.reward_functions.weights.to(rewards_per_function.device)
        combined = combine_rewards(rewards_per_function, weights)
        metrics = self._reward_metrics(rewards_per_function, combined)
        rewards = combined
        if self.reward_clip_range is not None:
            rewards = rewards.clamp(*self.reward_clip_range)
        if self.hparams.beta != 0:
            mask = rollout.completion_mask().to(rollout.old_logps.device)
            per_token = (rollout.old_logps - rollout.ref_logps) * mask
            rewards = rewards - self.hparams.beta * self._gather_rows(per_token.sum(-1)).to(rewards.device)
            metrics["kl"] = self._sum_over_ranks(per_token.sum()) / self._sum_over_ranks(mask.sum()).clamp(min=1)
        std = nanstd(rewards.view(-1, self.num_generations), dim=1)
        metrics["frac_reward_zero_std"] = torch.isclose(std, torch.zeros_like(std)).float().mean()
        advantages = leave_one_out_advantages(rewards, self.num_generations, self.hparams.normalize_advantages)
        return advantages, metrics

    def slice_loss(self, part: Rollout, normalizer: Tensor | None = None) -> PolicyLoss:
        """One micro-batch's loss: a clipped ratio per completion, averaged over the micro-batch."""
        logps, entropy, router_aux = self.completion_logps_and_entropies(part)
        mask = part.completion_mask().to(logps.device)
        old = None if part.old_logps is None else (part.old_logps * mask).sum(-1)
        out = rloo_policy_loss(
            logps, old, part.advantages.to(logps.device), mask, epsilon_low=self.epsilon_low,
            epsilon_high=self.epsilon_high, accumulation_steps=self.hparams.gradient_accumulation_steps,
        )  # fmt: skip
        return self.with_router_aux(replace(out, entropy=entropy.detach()), router_aux)

    def loss_normalizer(self, rollout: Rollout) -> None:
        """RLOO averages over completions: no token normalizer."""
        return None
