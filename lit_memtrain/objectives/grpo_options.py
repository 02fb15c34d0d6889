"""GRPOModule's loss-variant options (TRL 1.16's names, defaults and meaning), checked in one place.

Why a file of its own: TRL's ``GRPOConfig`` has a dozen knobs for its loss variants (GSPO, CISPO, SAPO, LUSPO,
VESPO, two-sided clipping, the off-policy mask, the high-entropy token mask, the entropy bonus). The module takes
them as constructor arguments under TRL's names; this dataclass validates them and hands the loss its share
(:func:`~lit_memtrain.objectives.policy_loss.clipped_policy_loss` takes the object), so the module only passes
them along.

Example:
    >>> options = PolicyLossOptions(importance_sampling_level="sequence", delta=1.5)
    >>> options.entropy_bonus
    False
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "IMPORTANCE_SAMPLING_LEVELS",
    "MULTI_OBJECTIVE_AGGREGATIONS",
    "ImportanceSamplingLevel",
    "PolicyLossOptions",
    "check_loss_combination",
    "check_multi_objective_aggregation",
]

ImportanceSamplingLevel = Literal["token", "sequence"]
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
MULTI_OBJECTIVE_AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")


@dataclass(frozen=True)
class PolicyLossOptions:
    """TRL 1.16's loss-variant and token-control options of ``GRPOConfig`` (same names and defaults).

    Attributes:
        importance_sampling_level: ``token`` or ``sequence`` (GSPO).
        delta: two-sided clipping: the importance weight is capped at ``delta`` (> 1; None: off).
        sapo_temperature_pos, sapo_temperature_neg: the ``sapo`` gate's temperatures (> 0).
        vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg: the ``vespo`` Gamma weighting.
        off_policy_mask_threshold: drop negative-advantage completions that drifted further than this (None: off).
        top_entropy_quantile: train the policy term on this top share of tokens by entropy (1.0: all).
        entropy_coef: the entropy bonus's coefficient (0: off unless adaptive); with ``use_adaptive_entropy``, the
            initial one, moved by ``entropy_coef_delta`` within ``[entropy_coef_min, entropy_coef_max]`` each
            optimizer step toward keeping the entropy above ``entropy_target`` (nats), applied only below it.
    """

    importance_sampling_level: ImportanceSamplingLevel = "token"
    delta: float | None = None
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    off_policy_mask_threshold: float | None = None
    top_entropy_quantile: float = 1.0
    entropy_coef: float = 0.0
    use_adaptive_entropy: bool = False
    entropy_coef_min: float = 0.0
    entropy_coef_max: float = 1.0
    entropy_coef_delta: float = 0.005
    entropy_target: float = 0.2

    def __post_init__(self) -> None:
        if self.importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
            raise ValueError(
                f"importance_sampling_level must be one of {IMPORTANCE_SAMPLING_LEVELS}, got "
                f"{self.importance_sampling_level!r}."
            )
        if self.delta is not None and not (_finite(self.delta) and self.delta > 1):
            raise ValueError(
                f"delta (two-sided clipping: the importance weight is capped at delta) must be > 1 or None (off; "
                f"TRL recommends > 1 + epsilon_high), got {self.delta!r}."
            )
        for name in ("sapo_temperature_pos", "sapo_temperature_neg"):
            value = getattr(self, name)
            if not (_finite(value) and value > 0):
                raise ValueError(f"{name} must be > 0 (the sapo gate divides by it), got {value!r}.")
        for name in ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg", "entropy_coef",
                     "entropy_target"):  # fmt: skip
            if not _finite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)!r}.")
        if self.off_policy_mask_threshold is not None and not _finite(self.off_policy_mask_threshold):
            raise ValueError(
                "off_policy_mask_threshold must be a finite number or None (off), got "
                f"{self.off_policy_mask_threshold!r}."
            )
        if not (_finite(self.top_entropy_quantile) and 0 <= self.top_entropy_quantile <= 1):
            raise ValueError(
                f"top_entropy_quantile must be in [0, 1] (1.0 trains every token), got {self.top_entropy_quantile!r}."
            )
        if self.use_adaptive_entropy and not (
            _finite(self.entropy_coef_delta) and self.entropy_coef_delta > 0
            and _finite(self.entropy_coef_min) and _finite(self.entropy_coef_max)
            and self.entropy_coef_min <= self.entropy_coef_max
        ):  # fmt: skip
            raise ValueError(
                "use_adaptive_entropy needs entropy_coef_delta > 0 and entropy_coef_min <= entropy_coef_max, got "
                f"{self.entropy_coef_delta!r}, {self.entropy_coef_min!r} and {self.entropy_coef_max!r}."
            )

    @property
    def entropy_bonus(self) -> bool:
        """Whether the loss has an entropy bonus (TRL: a non-zero ``entropy_coef``, or adaptive control)."""
        return self.entropy_coef != 0.0 or self.use_adaptive_entropy


def check_loss_combination(loss_type: str, importance_sampling_level: str) -> None:
    """Warn where TRL warns: a combination that runs but is not what its paper trains."""
    if loss_type == "luspo" and importance_sampling_level != "sequence":
        warnings.warn(
            "policy_loss='luspo' with importance_sampling_level='token': the LUSPO paper uses 'sequence'.", stacklevel=3
        )
    if loss_type == "vespo" and importance_sampling_level != "token":
        warnings.warn(
            "policy_loss='vespo' computes sequence-level weights itself: importance_sampling_level should be 'token'.",
            stacklevel=3,
        )
    if importance_sampling_level == "sequence" and loss_type in ("bnpo", "dr_grpo", "dapo", "cispo"):
        warnings.warn(
            f"importance_sampling_level='sequence' with policy_loss={loss_type!r} sums per-token terms, weighting each "
            "completion by its length; GSPO's setup is policy_loss='grpo'.",
            stacklevel=3,
        )


def check_multi_objective_aggregation(value: str) -> None:
    if value not in MULTI_OBJECTIVE_AGGREGATIONS:
        raise ValueError(f"multi_objective_aggregation must be one of {MULTI_OBJECTIVE_AGGREGATIONS}, got {value!r}.")


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
