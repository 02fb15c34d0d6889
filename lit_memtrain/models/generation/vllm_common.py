"""What the two vLLM backends share: the import check, the sampling translation, the requests and their answers.

Why one translation: :class:`~lit_memtrain.models.generation.sampling.SamplingSettings` must mean on vLLM what it
means on Hugging Face ``generate``. Checked against vLLM's documented ``SamplingParams`` and its sampler (vLLM
0.28 to 0.31) and transformers' logits processors:

- ``temperature``, ``top_p``, ``repetition_penalty`` (over the prompt and the completion so far, ``x / p`` for a
  positive logit, ``x * p`` otherwise) mean the same; penalties come first and temperature second on both.
- ``top_k``: 0 is off on both (vLLM also takes -1).
- ``min_p``: ``None`` is vLLM's 0.0 (off). vLLM applies it before ``top_k`` / ``top_p``, transformers after: the
  same with ``top_k`` (both keep a token by its probability relative to the most likely one), not with ``top_p``
  (the nucleus is taken over a renormalised distribution), so ``min_p`` with ``top_p < 1`` is refused.
- ``do_sample=False`` is vLLM's ``temperature=0`` (greedy, the penalties still applied), which vLLM draws with
  ``n=1`` only: the prompt is then sent ``num_generations`` times.
- vLLM refuses ``temperature > 2`` and silently raises one below 0.01 to 0.01: both are refused here.
- Completions stop at ``eos_token_ids`` only (``stop_token_ids`` with ``ignore_eos``, so the engine's own idea of
  the end-of-sequence token cannot stop one elsewhere), after ``max_completion_length`` tokens at most; a
  completion that comes back shorter without ending in one of them is an error, never passed on as truncated.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import Any

from lit_memtrain.models.generation.backend import cut_after_eos
from lit_memtrain.models.generation.sampling import SamplingSettings

__all__ = [
    "VLLM_INSTALL",
    "check_vllm_sampling",
    "checked_completions",
    "require_vllm",
    "vllm_requests",
    "vllm_sampling_params",
]

VLLM_INSTALL = "pip install 'lit-memtrain[vllm]'"
MIN_VLLM = (0, 28)
_MIN_TEMPERATURE, _MAX_TEMPERATURE = 0.01, 2.0


def require_vllm() -> ModuleType:
    """The ``vllm`` module, or an ImportError that says what to install (vLLM is an optional extra)."""
    try:
        import vllm
    except ImportError as error:
        raise ImportError(
            f"The vLLM generation backends need vLLM, which is not installed: {VLLM_INSTALL} (vLLM >= "
            f"{'.'.join(map(str, MIN_VLLM))}, a CUDA machine). Or generate with generation_backend='transformers'."
        ) from error
    version = tuple(int(part) for part in str(getattr(vllm, "__version__", "0")).split(".")[:2] if part.isdigit())
    if version < MIN_VLLM:
        raise ImportError(
            f"vLLM {getattr(vllm, '__version__', '?')} is installed; the vLLM generation backends need vLLM >= "
            f"{'.'.join(map(str, MIN_VLLM))} (its weight-transfer API): {VLLM_INSTALL}."
        )
    return vllm


def check_vllm_sampling(sampling: SamplingSettings) -> None:
    """Raise ValueError for settings vLLM would not draw as Hugging Face ``generate`` does (module docstring)."""
    if not sampling.do_sample:
        return
    if not _MIN_TEMPERATURE <= sampling.temperature <= _MAX_TEMPERATURE:
        raise ValueError(
            f"temperature={sampling.temperature}: vLLM samples only at temperatures in [{_MIN_TEMPERATURE}, "
            f"{_MAX_TEMPERATURE}] (it raises lower ones to {_MIN_TEMPERATURE}). Use do_sample=False for greedy "
            "decoding, or generation_backend='transformers'."
        )
    if sampling.min_p is not None and sampling.min_p > 0 and sampling.top_p < 1:
        raise ValueError(
            f"min_p={sampling.min_p} with top_p={sampling.top_p}: vLLM applies min_p before top_p and Hugging Face "
            "after, which keeps different tokens. Set one of them off, or use generation_backend='transformers'."
        )


def vllm_sampling_params(sampling: SamplingSettings, eos_token_ids: Sequence[int], n: int) -> dict[str, Any]:
    """The keyword arguments of vLLM's ``SamplingParams`` (and of its OpenAI completions request) for ``sampling``,
    ``n`` completions per prompt sent."""
    check_vllm_sampling(sampling)
    params: dict[str, Any] = {
        "n": n,
        "max_tokens": sampling.max_completion_length,
        "repetition_penalty": sampling.repetition_penalty,
        "stop_token_ids": [int(token) for token in eos_token_ids],
        "ignore_eos": True,  # stop at eos_token_ids only
    }
    if sampling.do_sample:
        params.update(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                      min_p=0.0 if sampling.min_p is None else sampling.min_p)  # fmt: skip
    else:
        params.update(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0)
    return params | (sampling.generation_kwargs or {})


def vllm_requests(
    prompt_ids: Sequence[Sequence[int]], num_generations: int, sampling: SamplingSettings
) -> tuple[list[list[int]], int]:
    """The prompts to send and the ``n`` to send them with, so that the answers, flattened in order, are
    ``num_generations`` completions per prompt, prompt-major: each prompt once with ``n = num_generations``, or,
    greedy (which vLLM draws with ``n = 1`` only), each prompt ``num_generations`` times."""
    if any(not ids for ids in prompt_ids):
        raise ValueError("Every prompt needs at least one token to generate from; got an empty prompt.")
    if sampling.do_sample:
        return [list(ids) for ids in prompt_ids], num_generations
    return [list(ids) for ids in prompt_ids for _ in range(num_generations)], 1


def checked_completions(
    completions: Sequence[Sequence[int]], expected: int, eos_token_ids: Sequence[int], max_length: int, engine: str
) -> list[list[int]]:
    """``completions`` cut after their first end of sequence, checked: as many as ``expected``, and each either
    ending in an end-of-sequence token or ``max_length`` long (else the engine stopped it for a reason the loss
    would not know of, e.g. its ``max_model_len``)."""
    if len(completions) != expected:
        raise RuntimeError(f"{engine} returned {len(completions)} completions where {expected} were asked for.")
    eos = set(eos_token_ids)
    kept = []
    for index, tokens in enumerate(completions):
        cut = cut_after_eos(tokens, eos_token_ids, max_length)
        if len(cut) < max_length and (not cut or cut[-1] not in eos):
            raise RuntimeError(
                f"{engine} stopped completion {index} after {len(cut)} of at most {max_length} tokens without an "
                f"end-of-sequence token {sorted(eos)}: raise the engine's max_model_len (prompt + "
                "max_completion_length tokens), or check its stop settings."
            )
        kept.append(cut)
    return kept
