"""The generation-backend interface of online RL: what a backend is given, and what it must return.

Why an interface: generation is where an RL step spends most of its time, and the fastest engine depends on the
setup (Hugging Face ``generate`` runs everywhere, under FSDP2 too; transformers' continuous batching and vLLM are
faster where they run). The training step asks a backend for completions and nothing else: it never sees how
they were drawn, so a backend can be swapped by one argument without changing the loss.

A backend must:

- return, for each of the ``P`` prompts (token ids, no padding), ``num_generations`` completions, prompt-major
  (completions ``i * G`` to ``i * G + G - 1`` answer prompt ``i``), as lists of token ids;
- cut each completion after its first end-of-sequence token (one of ``eos_token_ids``, kept) and stop at
  ``sampling.max_completion_length`` tokens; no padding;
- draw them with :class:`~lit_memtrain.models.generation.sampling.SamplingSettings` meaning what it says there;
- generate with the weights ``model`` has now: ``weights_version`` (the optimizer steps taken so far) changes
  whenever they did, so a backend that keeps its own copy of the weights (vLLM) reloads them only then;
- leave ``model`` as it found it (training mode, parameters, sharding), and be called by every rank together
  (each with its own prompts) when the model is sharded.

Three optional hooks let a backend fail early rather than in the middle of a step: the class methods
:meth:`GenerationBackend.check_available` (the packages it needs are installed) and
:meth:`GenerationBackend.check_sampling` (it draws these settings as they are meant), called when a module is
given the backend's name, before any model is built; and :meth:`GenerationBackend.setup` (the model it will
generate with can be handled, and any engine of its own is started), called once before the first generation, by
every rank together.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from lit_memtrain.models.generation.sampling import SamplingSettings

__all__ = ["GenerationBackend", "cut_after_eos"]


def cut_after_eos(completion: Sequence[int], eos_token_ids: Sequence[int], max_length: int) -> list[int]:
    """``completion`` through its first end-of-sequence token (kept), and at most ``max_length`` tokens.

    Example:
        >>> cut_after_eos([5, 6, 2, 7, 2], eos_token_ids=[2], max_length=8)
        [5, 6, 2]
    """
    eos = set(eos_token_ids)
    kept = []
    for token in list(completion)[:max_length]:
        kept.append(int(token))
        if token in eos:
            break
    return kept


class GenerationBackend(ABC):
    """Draws completions for a training step (see the module docstring for the contract).

    Args:
        sampling: how completions are drawn.
        eos_token_ids: every id that ends a completion (the tokenizer's end-of-sequence token and the model's
            ``generation_config.eos_token_id``, as TRL takes them).
        pad_token_id: the id prompts are padded with where a backend pads.
    """

    sampling_logprobs: list[list[float]] | None = None
    """Per-token log-probabilities of the last :meth:`generate`'s completions under the engine that sampled them
    (one list per completion, as long as it; NaN where the engine gave none), or None: the backend does not report
    them (the ``transformers`` backends sample with the trained weights themselves). The vLLM backends report them
    (vLLM's processed log-probabilities: after temperature and the logit processors), for TRL's vLLM
    importance-sampling correction."""

    def __init__(self, sampling: SamplingSettings, eos_token_ids: Sequence[int], pad_token_id: int) -> None:
        if not eos_token_ids:
            raise ValueError("A generation backend needs at least one end-of-sequence token id (eos_token_ids).")
        self.sampling = sampling
        self.eos_token_ids = [int(token) for token in eos_token_ids]
        self.pad_token_id = int(pad_token_id)

    @classmethod
    def check_available(cls) -> None:
        """Raise ImportError saying what to install when a package this backend needs is missing (default: none)."""

    @classmethod
    def check_sampling(cls, sampling: SamplingSettings) -> None:
        """Raise ValueError for settings this backend would not draw as :class:`SamplingSettings` means them
        (default: every setting is drawn as meant)."""

    @classmethod
    def check_options(cls, options: Mapping[str, Any]) -> None:
        """Raise ValueError naming every key of ``options`` that is not a keyword argument of this backend's
        constructor beyond the three every backend takes (what ``GRPOModule(generation_options=...)`` passes)."""
        variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
        parameters = list(inspect.signature(cls.__init__).parameters.values())[4:]  # after self and the three
        accepted = [parameter.name for parameter in parameters if parameter.kind not in variadic]
        unknown = sorted(set(options) - set(accepted))
        if unknown:
            raise ValueError(
                f"generation_options {unknown} are not options of {cls.__name__}; its options are {accepted or 'none'}."
            )

    def setup(self, model: nn.Module) -> None:
        """Check that this backend can generate with ``model`` and start what it runs on (default: nothing).

        Called once, before the first :meth:`generate`, by every rank together; raises a clear error where the
        backend cannot serve this model or device.
        """

    @abstractmethod
    def generate(
        self,
        model: nn.Module,
        prompt_ids: Sequence[Sequence[int]],
        num_generations: int,
        device: torch.device,
        weights_version: int,
    ) -> list[list[int]]:
        """``len(prompt_ids) * num_generations`` completions, prompt-major, each cut after its first EOS.

        Args:
            model: the policy being trained (a Hugging Face causal LM, possibly under a LoRA adapter or sharded
                with FSDP2), in training mode.
            prompt_ids: the prompts' token ids, one list per prompt.
            num_generations: completions per prompt.
            device: where the training step computes (under FSDP2 with host offload, not where parameters live).
            weights_version: the optimizer steps taken so far.
        """
