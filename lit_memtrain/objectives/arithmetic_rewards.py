"""Reward functions of the embedded arithmetic prompts (``configs/grpo.yaml``), in TRL's signature.

Why two: the exact answer is the task, but a model that starts from random weights almost never writes it, and a
group whose completions all score 0 has no advantage to learn from. ``digits_only`` rewards the form of an answer
(a number, nothing else) by degrees, so the first steps have a signal, the way TRL's examples pair an accuracy
reward with a format reward. Each reads a completion as text: a string, or the content of a conversational
completion's last message.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["digits_only", "exact_answer"]


def _text(completion: Any) -> str:
    return completion[-1]["content"] if isinstance(completion, list) else completion


def exact_answer(completions: Sequence[Any], answer: Sequence[str], **kwargs: Any) -> list[float]:
    """1.0 where the completion, stripped of surrounding space, is the ``answer`` column's value, else 0.0."""
    return [float(_text(completion).strip() == expected) for completion, expected in zip(completions, answer)]


def digits_only(completions: Sequence[Any], **kwargs: Any) -> list[float]:
    """The share of the completion's non-space characters that are digits (1.0 for a bare number, 0.0 for none)."""
    shares = []
    for completion in completions:
        characters = [c for c in _text(completion) if not c.isspace()]
        shares.append(sum(c.isdigit() for c in characters) / len(characters) if characters else 0.0)
    return shares
