"""A trained reward model as an online-RL reward function (TRL's signature ``f(prompts, completions, **columns)``).

Why an adapter: online RL (:class:`~lit_memtrain.objectives.grpo.GRPOModule`) scores completions with callables
that take the prompts and completions as text or chat messages, and a reward model takes token ids. The adapter
tokenizes each prompt + completion exactly as :class:`~lit_memtrain.datamodules.preference.PreferenceDataModule`
tokenized the pairs the model was trained on (strings joined with the eos appended, messages through the chat
template: :func:`~lit_memtrain.datamodules.tokenize.tokenize_prompt_completion`), so the model scores what it
learned to score, and reads the reward where the model itself reads it (its own forward on right-padded rows).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForSequenceClassification, PreTrainedTokenizerBase

from lit_memtrain.datamodules.collate import PaddedCollator
from lit_memtrain.datamodules.tokenize import tokenize_prompt_completion
from lit_memtrain.datamodules.hub_access import require_hub
from lit_memtrain.datamodules.tokenizer import load_tokenizer

__all__ = ["RewardModelFunction"]


class RewardModelFunction:
    """Score completions with a trained reward model, as a reward function of online RL.

    Args:
        model: the directory ``lit-memtrain export`` (or a fit's ``export_dir``) wrote for a
            :class:`~lit_memtrain.objectives.reward.RewardModule`, or a loaded one-output sequence-classification
            model (a PEFT model around one included).
        tokenizer: the tokenizer the model was trained with: a name or path, or a loaded one; by default the one in
            the ``model`` directory (an export holds it).
        batch_size: sequences scored per forward.
        device: where the model runs; by default the current CUDA device (a Lightning process's own), else the CPU.
        name: the name the RL module logs its rewards under (``rewards/<name>/mean``).

    Example:
        >>> score = RewardModelFunction("outputs/reward/export")  # doctest: +SKIP
        >>> GRPOModule(preset="tiny-qwen3", tokenizer="lit-memtrain/embedded", reward_funcs=[score])  # doctest: +SKIP
    """

    def __init__(
        self,
        model: str | nn.Module,
        tokenizer: str | PreTrainedTokenizerBase | None = None,
        batch_size: int = 16,
        device: str | torch.device | None = None,
        name: str = "reward_model",
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1 sequence, got {batch_size}.")
        if tokenizer is None:
            if not isinstance(model, str):
                raise ValueError("Give the tokenizer the reward model was trained with (tokenizer=...).")
            tokenizer = model
        if isinstance(model, str):
            require_hub(model, "reward model")
            model = AutoModelForSequenceClassification.from_pretrained(model)
        self.tokenizer = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
        config = model.config.get_text_config()
        labels = getattr(model.config, "num_labels", None)
        if labels != 1:
            raise ValueError(
                f"{type(model).__name__} has num_labels={labels}; a reward model has one output (the reward). Give "
                "the export of a RewardModule."
            )
        if config.pad_token_id != self.tokenizer.pad_token_id:
            raise ValueError(
                f"The reward model reads its reward past pad token id {config.pad_token_id}, but the tokenizer pads "
                f"with id {self.tokenizer.pad_token_id}: give the tokenizer the model was trained with."
            )
        self.model = model.eval().requires_grad_(False)
        self.batch_size = batch_size
        self.device = torch.device(device) if device is not None else None
        self.__name__ = name

    def _device(self) -> torch.device:
        if self.device is None:
            cuda = torch.cuda.is_available()
            self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        return self.device

    @torch.no_grad()
    def __call__(self, prompts: Sequence[Any], completions: Sequence[Any], **columns: Any) -> list[float]:
        """One reward per completion, each scored after its prompt (strings, or lists of chat messages); the other
        dataset columns and the RL module's keyword arguments are accepted and not read."""
        if len(prompts) != len(completions):
            raise ValueError(f"Got {len(prompts)} prompts for {len(completions)} completions; one each is expected.")
        sequences = [
            tokenize_prompt_completion({"prompt": prompt, "completion": completion}, self.tokenizer)["input_ids"]
            for prompt, completion in zip(prompts, completions)
        ]
        device = self._device()
        self.model.to(device)
        collate = PaddedCollator(self.tokenizer.pad_token_id)
        rewards: list[float] = []
        for start in range(0, len(sequences), self.batch_size):
            batch = collate([{"input_ids": ids, "labels": ids} for ids in sequences[start : start + self.batch_size]])
            inputs = {name: batch[name].to(device) for name in ("input_ids", "attention_mask")}
            rewards += self.model(**inputs, use_cache=False).logits[:, 0].float().tolist()
        return rewards
