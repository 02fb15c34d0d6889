"""TRL's vLLM importance-sampling correction: weighing each trained token by how likely the trainer finds what
the sampling engine drew.

Why: vLLM samples with its own kernels (and bf16 weights, another attention, a prefix cache), so the log-probabilities
it samples with differ from the ones the trainer computes for the same tokens; the policy gradient assumes they are
the same. TRL 1.16 (``vllm_importance_sampling_correction``, on by default with vLLM) multiplies each token's loss by
``rho = exp(old_logps - sampling_logps)``, per token or per sequence (the sum of the differences), truncated to
``[clip_min, clip_max]`` or masked to 0 outside it, and logs how far the two are apart. The ratio is computed once
per generation batch, from the trainer's log-probabilities at generation time (``old_logps``).

Example:
    >>> correction = SamplingCorrection(mode="token_truncate", clip_max=3.0)
    >>> ratio = correction.ratio(old_logps, sampling_logps, mask)  # doctest: +SKIP
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch import Tensor

__all__ = ["SAMPLING_CORRECTION_MODES", "SamplingCorrection", "SamplingCorrectionMode"]

SamplingCorrectionMode = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
SAMPLING_CORRECTION_MODES: tuple[str, ...] = get_args(SamplingCorrectionMode)


@dataclass(frozen=True)
class SamplingCorrection:
    """TRL's ``vllm_importance_sampling_mode``, ``_clip_min`` and ``_clip_max`` (see the module docstring).

    Attributes:
        mode: ``token_*`` (a ratio per token) or ``sequence_*`` (one per completion: the exp of the summed
            differences); ``*_truncate`` clamps the ratio to ``[clip_min, clip_max]``, ``*_mask`` sets it to 0
            outside.
        clip_max, clip_min: the bounds (``None``: none on that side).
    """

    mode: SamplingCorrectionMode = "sequence_mask"
    clip_max: float | None = 3.0
    clip_min: float | None = None

    def __post_init__(self) -> None:
        if self.mode not in SAMPLING_CORRECTION_MODES:
            raise ValueError(
                f"vllm_importance_sampling_mode must be one of {SAMPLING_CORRECTION_MODES}, got {self.mode!r}."
            )
        for name, value in (("clip_max", self.clip_max), ("clip_min", self.clip_min)):
            if value is not None and not value >= 0:
                raise ValueError(f"vllm_importance_sampling_{name} must be >= 0 or None, got {value}.")
        if self.clip_min is not None and self.clip_max is not None and self.clip_min > self.clip_max:
            raise ValueError(
                f"vllm_importance_sampling_clip_min ({self.clip_min}) is above vllm_importance_sampling_clip_max "
                f"({self.clip_max}): no ratio would be kept as it is."
            )

    @property
    def per_sequence(self) -> bool:
        return self.mode.startswith("sequence")

    def ratio(self, old_logps: Tensor, sampling_logps: Tensor, mask: Tensor) -> Tensor:
        """``[N, T]`` (token modes) or ``[N, 1]`` (sequence modes) weights of the tokens' losses, from the trainer's
        and the engine's ``[N, T]`` log-probabilities; a token the engine gave no log-probability for (NaN) counts
        as no difference, as in TRL."""
        difference = torch.nan_to_num((old_logps - sampling_logps) * mask, nan=0.0)
        if self.per_sequence:
            difference = difference.sum(-1, keepdim=True)
        ratio = torch.exp(difference)
        if self.mode.endswith("truncate"):
            return torch.clamp(ratio, min=self.clip_min, max=self.clip_max)
        low = -math.inf if self.clip_min is None else self.clip_min
        high = math.inf if self.clip_max is None else self.clip_max
        return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)

    def rank_statistics(self, old_logps: Tensor, sampling_logps: Tensor, mask: Tensor, ratio: Tensor) -> Tensor:
        """This rank's ``[mean |difference|, max |difference|, min ratio, mean ratio, max ratio]`` over its trained
        tokens (ratios: over its completions in sequence modes), NaN differences left out, as TRL computes them
        before gathering; an empty selection gives 0 (TRL's)."""
        kept = mask.bool()
        delta = (old_logps - sampling_logps).abs()[kept]
        delta = delta[~torch.isnan(delta)]
        ratios = ratio.flatten() if self.per_sequence else ratio[kept]

        def stat(values: Tensor, reduce) -> Tensor:
            return reduce(values) if values.numel() else values.new_zeros(())

        return torch.stack([stat(delta, torch.mean), stat(delta, torch.max), stat(ratios, torch.min),
                            stat(ratios, torch.mean), stat(ratios, torch.max)])  # fmt: skip

    @staticmethod
    def metrics(per_rank: Tensor) -> dict[str, Tensor]:
        """TRL's logged names and reductions of every rank's :meth:`rank_statistics` (``[world, 5]``, never NaN)."""
        return {
            "sampling/sampling_logp_difference/mean": per_rank[:, 0].mean(),
            "sampling/sampling_logp_difference/max": per_rank[:, 1].max(),
            "sampling/importance_sampling_ratio/min": per_rank[:, 2].min(),
            "sampling/importance_sampling_ratio/mean": per_rank[:, 3].mean(),
            "sampling/importance_sampling_ratio/max": per_rank[:, 4].max(),
        }

