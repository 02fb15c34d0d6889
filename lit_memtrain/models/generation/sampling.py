"""Sampling settings of online RL's generation, one meaning on every generation backend.

Why a frozen dataclass of its own: the same completions must be drawn whichever backend generates them
(Hugging Face ``generate``, transformers' continuous batching, vLLM), and the policy's log-probabilities are
computed at the same ``temperature`` the completions were sampled at. The names and defaults are TRL's
(``GRPOConfig``); each backend translates them to its own arguments.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["OWNED_GENERATION_ARGUMENTS", "SamplingSettings"]

OWNED_GENERATION_ARGUMENTS = frozenset({
    "max_new_tokens", "max_length", "max_tokens", "do_sample", "temperature", "top_p", "top_k", "min_p",
    "repetition_penalty", "eos_token_id", "pad_token_id", "stop_token_ids", "ignore_eos", "n", "num_return_sequences",
    "use_cache", "logprobs", "detokenize",
})  # fmt: skip
"""Arguments of ``generate`` / ``GenerationConfig`` and vLLM's ``SamplingParams`` that the settings (or the backend)
set themselves: ``generation_kwargs`` may not set them, so that the loss scores at the settings completions are
drawn with."""


@dataclass(frozen=True)
class SamplingSettings:
    """How completions are drawn.

    Attributes:
        max_completion_length: new tokens per completion at most (a completion that reaches it without an end of
            sequence is "truncated").
        temperature: the next-token logits are divided by it before sampling, and before every log-probability
            the loss uses (also with ``do_sample=False``, as TRL does).
        top_p: sample among the most likely tokens whose probabilities sum to ``top_p`` (1.0: all).
        top_k: sample among the ``top_k`` most likely tokens (0: all).
        min_p: drop tokens less likely than ``min_p`` times the most likely one (None: off).
        repetition_penalty: > 1 discourages tokens already in the prompt or completion (1.0: off).
        do_sample: False decodes greedily (deterministic completions, for tests and evaluation).
        generation_kwargs: TRL's: further arguments of the backend's sampling, passed as they are (``GenerationConfig``
            fields for the ``transformers`` backends, ``SamplingParams`` fields for vLLM, e.g.
            ``{"suppress_tokens": [...]}`` or ``{"presence_penalty": 0.5}``); not those the other settings own
            (:data:`OWNED_GENERATION_ARGUMENTS`).

    Raises:
        ValueError: a value outside its range, naming it.
    """

    max_completion_length: int = 512
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float | None = None
    repetition_penalty: float = 1.0
    do_sample: bool = True
    generation_kwargs: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.max_completion_length, bool) or not isinstance(self.max_completion_length, int):
            raise TypeError(f"max_completion_length must be an int, got {self.max_completion_length!r}.")
        if self.max_completion_length < 1:
            raise ValueError(f"max_completion_length must be at least 1 token, got {self.max_completion_length}.")
        if not self.temperature > 0:
            raise ValueError(
                f"temperature must be > 0 (it divides the logits), got {self.temperature}; for greedy decoding set "
                "do_sample=False."
            )
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0: off), got {self.top_k!r}.")
        if self.min_p is not None and not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1] or None, got {self.min_p}.")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0 (1.0: off), got {self.repetition_penalty}.")
        if not isinstance(self.do_sample, bool):
            raise TypeError(f"do_sample must be True or False, got {self.do_sample!r}.")
        if self.generation_kwargs is not None and not isinstance(self.generation_kwargs, dict):
            raise TypeError(f"generation_kwargs must be a dict of sampling arguments, got {self.generation_kwargs!r}.")
        owned = sorted(OWNED_GENERATION_ARGUMENTS.intersection(self.generation_kwargs or {}))
        if owned:
            raise ValueError(
                f"generation_kwargs may not set {owned}: the module's own options set them (max_completion_length, "
                "temperature, top_p, top_k, min_p, repetition_penalty, do_sample), and the loss scores completions at "
                "those settings. Set the options instead."
            )
