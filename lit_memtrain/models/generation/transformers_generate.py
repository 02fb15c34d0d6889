"""The default generation backend: Hugging Face ``generate`` on the model being trained.

Why the default: it needs nothing beyond transformers, runs on a CPU, on any GPU and under FSDP2, and generates
with the very weights being trained (no copy to keep in sync). What it must get right around the training step:

- eval mode and no gradients while generating, the training mode restored after (dropout off, no graph kept);
- the key-value cache on, passed explicitly: ``GradientCheckpointing`` turns ``config.use_cache`` off during fit,
  and without the cache every new token would recompute the whole prefix;
- the sampling settings passed as arguments, so a checkpoint's own ``generation_config`` (a hub model's
  ``temperature=0.6, top_k=20``) never overrides them;
- prompts left-padded in one batch, completions cut after their first end of sequence (TRL keeps that token);
- under FSDP2, the parameters gathered as :func:`~lit_memtrain.models.generation.sharded.unsharded_for_generation`
  says (``gather_weights``: the whole model once, TRL's ``ds3_gather_for_generation``; else layer by layer).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from lit_memtrain.models.generation.backend import GenerationBackend, cut_after_eos
from lit_memtrain.models.generation.sampling import SamplingSettings

__all__ = ["TransformersGenerate"]


class TransformersGenerate(GenerationBackend):
    """Completions from the model's own ``generate``, one batch of all prompts x generations.

    Args:
        sampling, eos_token_ids, pad_token_id: see :class:`~lit_memtrain.models.generation.backend.GenerationBackend`.
        gather_weights: under FSDP2, gather every layer's parameters once for the whole generation (faster, needs
            the memory of the whole model) rather than once per generated token (TRL's ``ds3_gather_for_generation``).

    Example:
        >>> backend = TransformersGenerate(SamplingSettings(max_completion_length=16), [2], pad_token_id=0)
        >>> completions = backend.generate(model, [[5, 6, 7]], 4, torch.device("cpu"), 0)  # doctest: +SKIP
    """

    def __init__(
        self,
        sampling: SamplingSettings,
        eos_token_ids: Sequence[int],
        pad_token_id: int,
        gather_weights: bool = True,
    ) -> None:
        super().__init__(sampling, eos_token_ids, pad_token_id)
        if not isinstance(gather_weights, bool):
            raise TypeError(f"gather_weights must be True or False, got {gather_weights!r}.")
        self.gather_weights = gather_weights

    def generate_kwargs(self) -> dict[str, Any]:
        """The arguments of ``generate`` for :attr:`sampling` (all given, so none comes from the model's config)."""
        s = self.sampling
        kwargs: dict[str, Any] = {
            "max_new_tokens": s.max_completion_length,
            "do_sample": s.do_sample,
            "repetition_penalty": s.repetition_penalty,
            "eos_token_id": self.eos_token_ids,
            "pad_token_id": self.pad_token_id,
            "use_cache": True,
            "disable_compile": True,
        }
        if s.do_sample:
            kwargs.update(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p)
        else:  # greedy: the sampling filters would only draw warnings from generate
            kwargs.update(temperature=None, top_p=None, top_k=None, min_p=None)
        return kwargs | (s.generation_kwargs or {})

    def generate(
        self,
        model: nn.Module,
        prompt_ids: Sequence[Sequence[int]],
        num_generations: int,
        device: torch.device,
        weights_version: int,
    ) -> list[list[int]]:
        from lit_memtrain.models.generation.sharded import unsharded_for_generation

        rows = [list(ids) for ids in prompt_ids for _ in range(num_generations)]
        if not rows:
            return []
        if any(not ids for ids in rows):
            raise ValueError("Every prompt needs at least one token to generate from; got an empty prompt.")
        width = max(len(ids) for ids in rows)
        input_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for row, ids in enumerate(rows):
            input_ids[row, width - len(ids) :] = torch.tensor(ids)
            attention_mask[row, width - len(ids) :] = 1
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad(), unsharded_for_generation(model, self.gather_weights) as synced_gpus:
                output = model.generate(
                    input_ids=input_ids.to(device),
                    attention_mask=attention_mask.to(device),
                    synced_gpus=synced_gpus,
                    **self.generate_kwargs(),
                )
        finally:
            model.train(was_training)
        limit = self.sampling.max_completion_length
        return [cut_after_eos(row, self.eos_token_ids, limit) for row in output[:, width:].tolist()]
