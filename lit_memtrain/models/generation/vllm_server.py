"""vLLM as a separately started server (TRL's ``vllm_mode="server"``): rank 0 asks, every rank gets its share.

Why: a server on GPUs of its own generates while nothing of it occupies the training GPUs, and one server serves
every rank. Start it first (TRL 1.16's documented flags; ``VLLM_SERVER_DEV_MODE=1`` exposes the weight-update and
cache endpoints; ``--logprobs-mode processed_logprobs`` makes the log-probabilities it reports for the importance-
sampling correction those it sampled with, after temperature)::

    VLLM_SERVER_DEV_MODE=1 CUDA_VISIBLE_DEVICES=7 vllm serve Qwen/Qwen3-0.6B \\
        --weight-transfer-config '{"backend": "nccl"}' --logprobs-mode processed_logprobs --port 8000

The served model must have the trained model's architecture: its weights are replaced by the trained ones before
the first generation and after every optimizer step.

The protocol (TRL's ``VLLMClient`` against vLLM 0.28 to 0.31), all from rank 0:

- once: ``GET /health`` until it answers (``connection_timeout``), ``GET /v1/models`` (the model's name), ``GET
  /server_info`` (a weight-transfer engine must be configured), ``GET /get_world_size``, then ``POST
  /init_weight_transfer_engine`` while this process joins the NCCL group as its rank 0 (the server's workers
  block in the rendezvous while answering, so the request runs in a thread);
- whenever ``weights_version`` changes: ``POST /start_weight_update``, ``POST /update_weights`` announcing every
  tensor's name, dtype and shape while the tensors stream as one packed NCCL broadcast, ``POST
  /finish_weight_update``, ``POST /reset_prefix_cache`` (its cache was computed with the old weights). Under
  FSDP2 every rank gathers each tensor (a collective), rank 0 sends it;
- each generation: every rank's prompts are gathered to rank 0, sent in one ``POST /v1/completions`` (token ids,
  ``n = num_generations``, ``return_token_ids``), and the completions broadcast back; each rank keeps its own.

Sampling: :mod:`~lit_memtrain.models.generation.vllm_common` (same meaning as Hugging Face ``generate``). Not
implemented: TRL's importance-sampling correction of vLLM's sampling probabilities (the loss treats the server's
completions as drawn from the trained policy, TRL's behaviour with ``vllm_importance_sampling_correction=False``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from lit_memtrain.models.generation.backend import GenerationBackend
from lit_memtrain.models.generation.nccl_transport import NcclWeightTransport
from lit_memtrain.models.generation.sampling import SamplingSettings
from lit_memtrain.models.generation.vllm_common import (
    check_vllm_sampling,
    checked_completions,
    require_vllm,
    vllm_requests,
    vllm_sampling_params,
)
from lit_memtrain.models.generation.vllm_server_client import VLLMServerClient
from lit_memtrain.models.generation.weight_sync import inference_weights, materialized

__all__ = ["VLLMServer"]


def _rank_and_world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class VLLMServer(GenerationBackend):
    """Completions from a separately started ``vllm serve``, its weights pushed from the trained model.

    Args:
        sampling, eos_token_ids, pad_token_id: see :class:`~lit_memtrain.models.generation.backend.GenerationBackend`.
        base_url: where the server listens.
        group_port: the port of the NCCL group that carries the weights (on this machine, rank 0's).
        connection_timeout: seconds to wait for the server to answer at setup.

    Example:
        >>> GRPOModule(..., generation_backend="vllm_server",
        ...            generation_options={"base_url": "http://10.0.0.7:8000"})  # doctest: +SKIP
    """

    def __init__(
        self,
        sampling: SamplingSettings,
        eos_token_ids: Sequence[int],
        pad_token_id: int,
        base_url: str = "http://localhost:8000",
        group_port: int = 51216,
        connection_timeout: float = 240.0,
    ) -> None:
        super().__init__(sampling, eos_token_ids, pad_token_id)
        require_vllm()
        check_vllm_sampling(sampling)
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {base_url!r}.")
        if not 0 < connection_timeout:
            raise ValueError(f"connection_timeout must be > 0 seconds, got {connection_timeout}.")
        self.base_url, self.group_port, self.connection_timeout = base_url, group_port, connection_timeout
        self.client: VLLMServerClient | None = None
        self._weights_version: int | None = None

    @classmethod
    def check_available(cls) -> None:
        require_vllm()

    @classmethod
    def check_sampling(cls, sampling: SamplingSettings) -> None:
        check_vllm_sampling(sampling)

    def setup(self, model: nn.Module) -> None:
        """Rank 0 connects to the server and sets up the weight transfer; every rank checks the model's weights."""
        if self.client is not None:
            return
        inference_weights(model)  # refuse a model whose weights cannot be sent, on every rank
        client = VLLMServerClient(self.base_url, NcclWeightTransport())
        if _rank_and_world()[0] == 0:
            client.connect(self.connection_timeout)
            client.init_weight_transfer(self.group_port)
        self.client = client

    def generate(
        self,
        model: nn.Module,
        prompt_ids: Sequence[Sequence[int]],
        num_generations: int,
        device: torch.device,
        weights_version: int,
    ) -> list[list[int]]:
        self.setup(model)
        rank, world = _rank_and_world()
        if weights_version != self._weights_version:
            self._push_weights(model, device, rank)
            self._weights_version = weights_version
        every_rank: list[Any] = [list(map(list, prompt_ids))]
        if world > 1:
            every_rank = [None] * world
            dist.all_gather_object(every_rank, list(map(list, prompt_ids)))
        answer: list[Any] = [None]
        if rank == 0:
            answer = [self._complete([ids for prompts in every_rank for ids in prompts], num_generations)]
        if world > 1:
            dist.broadcast_object_list(answer, src=0)
        completions, logprobs, error = answer[0]
        if error is not None:
            raise RuntimeError(f"Generation on the vLLM server failed (on rank 0): {error}")
        start = sum(len(prompts) for prompts in every_rank[:rank]) * num_generations
        end = start + len(prompt_ids) * num_generations
        self.sampling_logprobs = logprobs[start:end]
        return completions[start:end]

    def _complete(
        self, prompt_ids: list[list[int]], num_generations: int
    ) -> tuple[list[list[int]] | None, list[list[float]] | None, str | None]:
        """Rank 0's request for every rank's prompts: the completions and their sampling log-probabilities, or the
        error every rank then raises."""
        if not prompt_ids:
            return [], [], None
        try:
            prompts, n = vllm_requests(prompt_ids, num_generations, self.sampling)
            params = vllm_sampling_params(self.sampling, self.eos_token_ids, n)
            sampled, logprobs = self.client.complete(prompts, params)
            limit = self.sampling.max_completion_length
            expected = len(prompt_ids) * num_generations
            completions = checked_completions(sampled, expected, self.eos_token_ids, limit, "The vLLM server")
            return completions, [values[: len(kept)] for values, kept in zip(logprobs, completions)], None
        except (RuntimeError, ValueError, OSError) as error:
            return None, None, f"{type(error).__name__}: {error}"

    def _push_weights(self, model: nn.Module, device: torch.device, rank: int) -> None:
        """Send the trained weights; under FSDP2 every rank gathers each tensor with rank 0, which sends it."""
        weights = inference_weights(model)
        if rank == 0:
            self.client.update_weights(weights, materialized(weights, device))
        elif any(isinstance(p, DTensor) for p in model.parameters()):
            for _ in materialized(weights, device):  # take part in each gather
                pass
