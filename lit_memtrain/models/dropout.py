"""Dropout of a built model: setting every probability to 0 (TRL's ``disable_dropout``) and reading what is left.

Why apart: the reward model and online RL (policy and frozen reference) switch dropout off the same way TRL's
``disable_dropout_in_model`` does, after LoRA wraps the model, so that the adapter's own dropout goes too; and GRPO
says once what dropout its training forwards keep that its sampling does not use.

Example:
    >>> from torch import nn
    >>> model = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.1))
    >>> dropout_probabilities(model), disable_dropout(model), dropout_probabilities(model)
    ([0.1], None, [])
"""

from __future__ import annotations

from torch import nn

__all__ = ["disable_dropout", "dropout_probabilities"]


def disable_dropout(model: nn.Module) -> None:
    """Set the probability of every ``nn.Dropout`` in ``model`` to 0 (TRL's ``disable_dropout_in_model``)."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0


def dropout_probabilities(model: nn.Module) -> list[float]:
    """The distinct non-zero dropout probabilities of ``model``'s ``nn.Dropout`` layers, sorted."""
    return sorted({module.p for module in model.modules() if isinstance(module, nn.Dropout) and module.p > 0})
