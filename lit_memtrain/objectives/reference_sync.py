"""Moving the frozen reference toward the policy every few optimizer steps (TRL's ``sync_ref_model``).

Why: with a KL term the policy is held near its reference; TRL's ``SyncRefModelCallback`` (TR-DPO, arXiv
2404.09656) mixes the policy into the reference every ``ref_model_sync_steps`` optimizer steps,
``reference = alpha * policy + (1 - alpha) * reference``, so that the anchor follows training. The mixed
reference is part of the run's state: :class:`~lit_memtrain.objectives.grpo.GRPOModule` keeps it in checkpoints.

Example:
    >>> sync = ReferenceSync(alpha=0.6, every=512)
    >>> sync.after_step(policy, reference, global_step)  # doctest: +SKIP
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["ReferenceSync"]


@dataclass(frozen=True)
class ReferenceSync:
    """TRL's ``ref_model_mixup_alpha`` (``alpha``) and ``ref_model_sync_steps`` (``every``)."""

    alpha: float = 0.6
    every: int = 512

    def __post_init__(self) -> None:
        if not 0 <= self.alpha <= 1:
            raise ValueError(f"ref_model_mixup_alpha must be in [0, 1], got {self.alpha}.")
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"ref_model_sync_steps must be an int >= 1, got {self.every!r}.")

    @torch.no_grad()
    def after_step(self, policy: nn.Module, reference: nn.Module, global_step: int) -> bool:
        """After the optimizer step that made ``global_step`` steps: mix ``policy`` into ``reference`` when
        ``global_step`` is a multiple of ``every`` (TRL's ``on_step_end``); whether it did."""
        if global_step % self.every:
            return False
        pairs = list(zip(reference.parameters(), policy.parameters(), strict=True))
        for target, source in pairs:
            target.data.mul_(1.0 - self.alpha).add_(source.data.to(target.device), alpha=self.alpha)
        return True
