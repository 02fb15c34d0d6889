"""ExactAnswerAccuracy: the share of held-out prompts the model answers exactly, before and after a fit.

Why: a falling loss does not say whether the model now gets answers right, nor how far it came from where it
started. This callback scores the module's model by greedy generation on held-out prompts with verifiable answers
(:mod:`lit_memtrain.objectives.answer_accuracy`) before the first step (of a resumed fit: the resumed model, at
the step it resumes from) and when the fit ends; each score is logged as ``val/exact_answer_accuracy`` at its step
and printed, the last line with both.

It reads the module's ``model`` and ``tokenizer`` attributes (any module that holds a Hugging Face causal LM and
its tokenizer); every rank scores the same prompts, so the model's forwards stay in step under a sharded strategy.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info

from lit_memtrain.datamodules.embedded import ADDITION_HELDOUT
from lit_memtrain.objectives.answer_accuracy import AnswerScore, load_answer_prompts, score_exact_answers

__all__ = ["ExactAnswerAccuracy"]


class ExactAnswerAccuracy(Callback):
    """Score exact answers on held-out prompts at the start and the end of a fit.

    Args:
        dataset: a prompt dataset with an ``answer`` column (the embedded held-out additions by default).
        num_prompts: how many of its first prompts are scored.
        split: the dataset's held-out split (needed when it has several; ``None``: its only split).
        val_size, seed: score the prompts a ``PromptDataModule(val_size=..., seed=...)`` holds out of the split
            (the fit trained on the others).
        chat_template_kwargs: arguments of the chat template that renders the prompts (``{"enable_thinking":
            False}``); ``None``: those of the fit's datamodule (``PromptDataModule(chat_template_kwargs=...)``), so
            the prompts are rendered as the model trained on them.
        max_new_tokens: the longest completion generated.
        batch_size: prompts generated together.

    Example:
        >>> trainer = Trainer(callbacks=[ExactAnswerAccuracy(num_prompts=200)])  # doctest: +SKIP
        >>> # lit-memtrain fit ... --trainer.callbacks+=lit_memtrain.callbacks.ExactAnswerAccuracy
    """

    def __init__(
        self,
        dataset: str = ADDITION_HELDOUT,
        num_prompts: int = 200,
        max_new_tokens: int = 8,
        batch_size: int = 50,
        split: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        val_size: float = 0,
        seed: int = 42,
    ) -> None:
        if num_prompts < 1 or max_new_tokens < 1 or batch_size < 1:
            raise ValueError(
                f"num_prompts, max_new_tokens and batch_size must be at least 1; got {num_prompts}, {max_new_tokens} "
                f"and {batch_size}."
            )
        self.dataset = dataset
        self.num_prompts = num_prompts
        self.max_new_tokens = max_new_tokens
        self.batch_size = batch_size
        self.split = split
        self.chat_template_kwargs = chat_template_kwargs
        self.val_size = val_size
        self.seed = seed
        self.scores: list[tuple[int, AnswerScore]] = []  # (global step, score), in the order measured
        self._rows: list[dict[str, Any]] | None = None

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        # a bad dataset fails before the model loads
        self._rows = load_answer_prompts(self.dataset, self.num_prompts, self.split, self.val_size, self.seed)

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.scores = []  # this fit's: a callback fitted again compares its own two

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Not in on_fit_start: Lightning restores a resumed fit's weights before that hook and its step count after
        # it, so a resumed model was scored there as "before training" at step 0.
        resumed = trainer.global_step > 0
        self._score(trainer, pl_module, "at the start of the resumed fit" if resumed else "before training")

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        score = self._score(trainer, pl_module, "after training")
        if len(self.scores) > 1:
            start, first = self.scores[0]
            since = f"at step {start}" if start else "before training"
            rank_zero_info(
                f"exact-answer accuracy on {self.num_prompts} prompts of {self.dataset}: {first} {since} -> {score} "
                f"after {trainer.global_step} steps"
            )

    def template_arguments(self, trainer: Trainer) -> dict[str, Any]:
        """The chat template's arguments the prompts are rendered with: this callback's, else the fit's datamodule's."""
        if self.chat_template_kwargs is not None:
            return self.chat_template_kwargs
        return dict(getattr(trainer.datamodule, "chat_template_kwargs", None) or {})

    def _score(self, trainer: Trainer, pl_module: LightningModule, when: str) -> AnswerScore:
        tokenizer = getattr(pl_module, "tokenizer", None)
        if tokenizer is None:
            raise ValueError(
                f"ExactAnswerAccuracy generates with the module's tokenizer, and {type(pl_module).__name__} has none: "
                "give the module a tokenizer (lit-memtrain fit links data.tokenizer to it)."
            )
        score = score_exact_answers(
            pl_module.model, tokenizer, self._rows, self.max_new_tokens, self.batch_size,
            self.template_arguments(trainer),
        )  # fmt: skip
        self.scores.append((trainer.global_step, score))
        for logger in trainer.loggers:
            logger.log_metrics({"val/exact_answer_accuracy": score.accuracy}, step=trainer.global_step)
        rank_zero_info(f"exact-answer accuracy {when} (step {trainer.global_step}): {score}")
        return score
