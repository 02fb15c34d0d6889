"""Transformers' continuous batching (``model.generate_batch``, a paged KV cache) as a generation backend.

Why: ``generate`` pads every prompt of a batch to the longest and keeps every row until the longest completion
ends; continuous batching schedules requests on a paged cache, so finished completions free their pages and new
ones start (TRL's ``use_transformers_paged``). It needs nothing beyond transformers and runs on the CPU.

What it must get right, as :class:`~lit_memtrain.models.generation.transformers_generate.TransformersGenerate`
does: eval mode and no gradients while generating, the training mode and the attention implementation restored
after (the manager switches to a paged attention while it runs), the sampling settings given in a
``GenerationConfig`` of their own (a checkpoint's never overrides them), completions cut after their first end of
sequence. Greedy completions equal ``generate``'s (tested). The house's document attention (``sdpa_by_document``,
which continuous batching does not know) is swapped for ``sdpa`` while generating: one sequence a row needs no
document boundaries.

Refused rather than drawn differently: ``repetition_penalty != 1`` (transformers' continuous batching drops that
logits processor with a warning), and a model sharded with FSDP2 (the manager runs the model's forward from a
thread of its own, which FSDP2's collectives cannot follow). The cache is sized for the whole generation batch at
once unless ``num_blocks`` says otherwise (transformers' own default sizes it from the device's free memory, which
on a CPU host means a very large cache and tens of seconds per call).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from lit_memtrain.models.generation.backend import GenerationBackend, cut_after_eos
from lit_memtrain.models.generation.sampling import SamplingSettings

__all__ = ["TransformersContinuousBatching"]

# Attention implementations continuous batching runs (transformers' check), and the one it runs in place of the
# house's document attention (which keeps packed training documents apart; generation has one sequence a row).
_CB_ATTENTION = ("sdpa", "eager", "paged|eager")
_CB_INSTEAD = {"sdpa_by_document": "sdpa", "varlen_by_document": "sdpa"}


class TransformersContinuousBatching(GenerationBackend):
    """Completions from transformers' continuous batching on the model being trained.

    Args:
        sampling, eos_token_ids, pad_token_id: see :class:`~lit_memtrain.models.generation.backend.GenerationBackend`.
        page_size: tokens per page of the paged KV cache.
        num_blocks: pages in the cache (None: enough for every completion of a generation batch at full length).
        max_batch_tokens: tokens one forward of the scheduler processes at most (None: the prompts and one new
            token of every completion, at most 8192).

    Example:
        >>> GRPOModule(..., generation_backend="transformers_continuous",
        ...            generation_options={"page_size": 64})  # doctest: +SKIP
    """

    def __init__(
        self,
        sampling: SamplingSettings,
        eos_token_ids: Sequence[int],
        pad_token_id: int,
        page_size: int = 256,
        num_blocks: int | None = None,
        max_batch_tokens: int | None = None,
    ) -> None:
        super().__init__(sampling, eos_token_ids, pad_token_id)
        self.check_sampling(sampling)
        for name, value in (("page_size", page_size), ("num_blocks", num_blocks), ("max_batch_tokens", max_batch_tokens)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an int >= 1{' or None' if name != 'page_size' else ''}, got {value!r}.")
        self.page_size, self.num_blocks, self.max_batch_tokens = page_size, num_blocks, max_batch_tokens

    @classmethod
    def check_sampling(cls, sampling: SamplingSettings) -> None:
        if sampling.repetition_penalty != 1.0:
            raise ValueError(
                f"repetition_penalty={sampling.repetition_penalty}: transformers' continuous batching drops the "
                "repetition penalty (with a warning), so completions would be drawn without it. Use "
                "generation_backend='transformers', or repetition_penalty=1.0."
            )

    def setup(self, model: nn.Module) -> None:
        from torch.distributed.fsdp import FSDPModule

        if isinstance(model, FSDPModule) or any(isinstance(m, FSDPModule) for m in model.modules()):
            raise ValueError(
                "generation_backend='transformers_continuous' cannot generate with a model sharded by FSDP2 (the "
                "continuous-batching manager runs the forward in a thread of its own). Use "
                "generation_backend='transformers' (gather_weights_for_generation chooses how weights are gathered)."
            )
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        attention = str(base.config._attn_implementation)
        if attention not in _CB_ATTENTION and attention not in _CB_INSTEAD and "flash" not in attention:
            raise ValueError(
                f"transformers' continuous batching cannot run attn_implementation={attention!r} (it runs 'sdpa', "
                "'eager' and flash attention). Use generation_backend='transformers'."
            )
        if not hasattr(model, "generate_batch"):
            raise ValueError(
                f"{type(model).__name__} has no generate_batch: transformers' continuous batching needs transformers "
                ">= 5 and a generative Hugging Face model. Use generation_backend='transformers'."
            )

    def generation_config(self, num_return_sequences: int):  # noqa: ANN201 (transformers' GenerationConfig)
        """The ``GenerationConfig`` of one call: the sampling settings and nothing from the model's own config."""
        from transformers import GenerationConfig

        s = self.sampling
        sampled = {"temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k, "min_p": s.min_p}
        return GenerationConfig(
            max_new_tokens=s.max_completion_length, do_sample=s.do_sample, num_return_sequences=num_return_sequences,
            eos_token_id=list(self.eos_token_ids), pad_token_id=self.pad_token_id, repetition_penalty=1.0,
            **(sampled if s.do_sample else {"temperature": None, "top_p": None, "top_k": None, "min_p": None}),
            **(s.generation_kwargs or {}),
        )  # fmt: skip

    def cache_config(self, prompt_ids: Sequence[Sequence[int]], completions: int):  # noqa: ANN201
        """The paged cache's ``ContinuousBatchingConfig``: room for ``completions`` sequences of their prompt plus
        ``max_completion_length`` tokens, unless ``num_blocks`` / ``max_batch_tokens`` were given."""
        from transformers import ContinuousBatchingConfig

        longest = max(len(ids) for ids in prompt_ids) + self.sampling.max_completion_length
        blocks = self.num_blocks or completions * math.ceil(longest / self.page_size) + 1
        batch_tokens = self.max_batch_tokens or min(8192, sum(len(ids) for ids in prompt_ids) + completions)
        return ContinuousBatchingConfig(page_size=self.page_size, num_blocks=blocks, max_batch_tokens=batch_tokens)

    def generate(
        self,
        model: nn.Module,
        prompt_ids: Sequence[Sequence[int]],
        num_generations: int,
        device: torch.device,
        weights_version: int,
    ) -> list[list[int]]:
        if not prompt_ids:
            return []
        if any(not ids for ids in prompt_ids):
            raise ValueError("Every prompt needs at least one token to generate from; got an empty prompt.")
        self.setup(model)
        # Greedy decoding draws one sequence per request: each prompt is then sent num_generations times.
        per_request = num_generations if self.sampling.do_sample else 1
        requests = [list(ids) for ids in prompt_ids for _ in range(num_generations // per_request)]
        expected = len(prompt_ids) * num_generations
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        attention = base.config._attn_implementation
        was_training = model.training
        model.eval()
        try:
            if attention in _CB_INSTEAD:
                base.set_attn_implementation(_CB_INSTEAD[attention])
            with torch.no_grad():
                outputs = model.generate_batch(
                    requests, generation_config=self.generation_config(per_request),
                    continuous_batching_config=self.cache_config(requests, expected), warmup=False,
                )  # fmt: skip
        finally:
            if base.config._attn_implementation != attention:
                base.set_attn_implementation(attention)
            model.train(was_training)
        failed = [f"{key}: {out.error}" for key, out in outputs.items() if out.error is not None]
        if failed or len(outputs) != expected:
            raise RuntimeError(
                f"transformers' continuous batching returned {len(outputs)} completions of {expected}"
                f"{' with errors: ' + '; '.join(failed[:3]) if failed else ''}."
            )
        limit = self.sampling.max_completion_length
        return [cut_after_eos(out.generated_tokens, self.eos_token_ids, limit) for out in outputs.values()]
