"""Exact-answer accuracy: the share of held-out prompts a model answers exactly, by greedy generation.

Why: the training loss says how well a model predicts the reference tokens, not whether it gets the answer right.
For tasks whose answers can be checked (``configs/grpo.yaml``'s and ``configs/smollm2_sft.yaml``'s two-digit
additions), the task's own measure is the share of prompts whose greedy completion is the exact answer, as
:func:`~lit_memtrain.objectives.arithmetic_rewards.exact_answer` rewards it. The prompts are rows of a prompt dataset
with an ``answer`` column (TRL's prompt-only format, conversational or plain), e.g.
:data:`~lit_memtrain.datamodules.embedded.ADDITION_HELDOUT`, whose questions
:data:`~lit_memtrain.datamodules.embedded.ADDITION` never asks. Shared by ``lit-memtrain evaluate`` and the
:class:`~lit_memtrain.callbacks.ExactAnswerAccuracy` callback (before and after a fit).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from lit_memtrain.datamodules.sources import load_raw_dataset
from lit_memtrain.datamodules.splits import hold_out
from lit_memtrain.models.generate import greedy_completions
from lit_memtrain.objectives.arithmetic_rewards import exact_answer

__all__ = ["AnswerScore", "load_answer_prompts", "score_exact_answers"]


class AnswerScore(NamedTuple):
    """How many of ``total`` prompts were answered exactly."""

    correct: int
    total: int

    @property
    def accuracy(self) -> float:
        return self.correct / self.total

    def __str__(self) -> str:
        return f"{self.correct}/{self.total} ({100 * self.accuracy:.1f}%)"


def load_answer_prompts(
    dataset: str, num_prompts: int, split: str | None = None, val_size: float = 0, seed: int = 42
) -> list[dict[str, Any]]:
    """The first ``num_prompts`` rows (``prompt`` and ``answer``) of ``dataset``'s ``split``: when ``None``, its only
    split; with ``val_size``, of the prompts a fit's ``PromptDataModule(val_size=..., seed=...)`` holds out of it
    (:func:`~lit_memtrain.datamodules.splits.hold_out`, as the datamodule calls it).

    Why no default split: a dataset with several (``train`` and ``test``) trained on one of them, and the score of
    prompts the model trained on says nothing of held-out ones; which one is held out is the user's to say. Why
    ``val_size``: a fit that held prompts out of its training split trained on the others, its first rows among them.

    Raises:
        ValueError: ``split`` is not one of the dataset's, or is ``None`` and the dataset has several; the dataset
            has no ``prompt`` or ``answer`` column, or fewer than ``num_prompts`` rows.
    """
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be at least 1, got {num_prompts}.")
    splits = load_raw_dataset(dataset).data
    if split is None and len(splits) > 1:
        raise ValueError(
            f"Dataset {dataset!r} has the splits {list(splits)}: name the held-out one to score (split=..., "
            "lit-memtrain evaluate --split ...); the first rows of a training split are prompts the model trained on."
        )
    if split is not None and split not in splits:
        raise ValueError(f"Dataset {dataset!r} has no split {split!r}; its splits: {list(splits)}.")
    split = splits[split if split is not None else next(iter(splits))]
    if val_size:
        split = hold_out(split, val_size, seed, "prompts")[1]
    missing = [column for column in ("prompt", "answer") if column not in split.column_names]
    if missing:
        raise ValueError(
            f"Dataset {dataset!r} has no {' or '.join(repr(c) for c in missing)} column (its columns: "
            f"{split.column_names}): exact-answer accuracy needs prompts with their answer, as in "
            "lit-memtrain/addition-heldout."
        )
    if len(split) < num_prompts:
        held = f" (held out with val_size={val_size}, seed={seed})" if val_size else ""
        raise ValueError(
            f"Dataset {dataset!r} has {len(split)} prompts{held}, fewer than num_prompts={num_prompts}."
        )
    return [{"prompt": row["prompt"], "answer": str(row["answer"])} for row in split.select(range(num_prompts))]


def score_exact_answers(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    rows: list[dict[str, Any]],
    max_new_tokens: int = 8,
    batch_size: int = 32,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> AnswerScore:
    """The number of ``rows`` whose greedy completion (``max_new_tokens`` at most) is exactly their ``answer``; the
    prompts rendered with ``chat_template_kwargs`` (those the model trained with)."""
    prompts = [row["prompt"] for row in rows]
    completions = greedy_completions(model, tokenizer, prompts, max_new_tokens, batch_size, chat_template_kwargs)
    rewards = exact_answer(completions, [row["answer"] for row in rows])
    return AnswerScore(int(sum(rewards)), len(rows))
