"""The entropy bonus's coefficient, fixed or adaptive, as TRL 1.16's ``GRPOTrainer`` keeps it.

Why state of its own: with ``use_adaptive_entropy`` (Skywork-OR1) the coefficient changes at each optimizer step
from the entropy measured over the step's micro-batches on every rank, and is applied only while the entropy of the
previous step is at or below ``entropy_target`` (none before the first measurement). The state goes into
checkpoints so a resumed run continues with the same coefficient.

Example:
    >>> bonus = EntropyBonus(PolicyLossOptions(entropy_coef=0.01, use_adaptive_entropy=True, entropy_target=2.0))
    >>> bonus.coefficient()  # nothing measured yet: TRL applies none
    0.0
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from lit_memtrain.objectives.grpo_options import PolicyLossOptions

__all__ = ["EntropyBonus"]


class EntropyBonus:
    """The coefficient each micro-batch's entropy bonus uses, and its adaptive update at optimizer steps."""

    def __init__(self, options: PolicyLossOptions) -> None:
        self.options = options
        self.coef = options.entropy_coef
        self.last_entropy = math.inf  # TRL's: no bonus in the first window under adaptive control
        self._window: Tensor | None = None

    @property
    def enabled(self) -> bool:
        return self.options.entropy_bonus

    def coefficient(self) -> float | None:
        """This micro-batch's coefficient (the same for a whole optimizer step); None: no bonus."""
        if not self.enabled:
            return None
        if self.options.use_adaptive_entropy:
            return self.coef if self.last_entropy <= self.options.entropy_target else 0.0
        return self.coef

    def observe(self, entropy_sum: Tensor, tokens: Tensor) -> None:
        """Add a trained micro-batch's entropy sum and token count (over the bonus's tokens) to the step's window."""
        if self.options.use_adaptive_entropy:
            stats = torch.stack([entropy_sum.detach().float(), tokens.detach().float()])
            self._window = stats if self._window is None else self._window + stats

    def end_step(self, sum_over_ranks: Callable[[Tensor], Tensor]) -> None:
        """At an optimizer step: the window's mean entropy over every rank moves the adaptive coefficient."""
        if self._window is None:
            return
        totals = sum_over_ranks(self._window)
        entropy = float(totals[0] / totals[1].clamp(min=1.0))
        options = self.options
        if entropy <= options.entropy_target:
            self.coef = min(self.coef + options.entropy_coef_delta, options.entropy_coef_max)
        else:
            self.coef = max(self.coef - options.entropy_coef_delta, options.entropy_coef_min)
        self.last_entropy = entropy
        self._window = None

    def state_dict(self) -> dict[str, Any]:
        return {"entropy_coef": self.coef, "last_world_entropy": self.last_entropy}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.coef, self.last_entropy = float(state["entropy_coef"]), float(state["last_world_entropy"])
