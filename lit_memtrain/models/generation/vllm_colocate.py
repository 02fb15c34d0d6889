"""vLLM in the training process (TRL's ``vllm_mode="colocate"``): one engine per rank, asleep between generations.

Why: vLLM generates many times faster than Hugging Face ``generate`` (paged KV cache, continuous batching, CUDA
graphs), and in the training process it needs no second machine. The price is a second copy of the weights on
every GPU and the engine's KV cache; sleep mode gives both back while the step trains.

How (TRL 1.16's ``VLLMGeneration``, against vLLM's documented API):

- **Engine**: ``vllm.LLM`` built at :meth:`VLLMColocate.setup` from the trained model's config (written to a
  temporary directory) with ``load_format="dummy"``: the weights always come from the trained model, so the
  checkpoint is never read a second time and a model built from a preset works too. One engine per rank
  (``distributed_executor_backend="external_launcher"``, one GPU each), each generating its own rank's prompts,
  seeded ``seed + rank``.
- **Weights**: whenever ``weights_version`` changes (an optimizer step), every tensor is sent to the engine, one
  at a time (:mod:`~lit_memtrain.models.generation.weight_sync`: gathered under FSDP2, LoRA merged out of place)
  through the model runner's ``load_weights``; then the prefix cache, computed with the old weights, is reset.
- **Sleep mode** (``sleep_level``): after each generation the engine sleeps: level 2 (the default, TRL's) drops
  its weights and KV cache, so the next generation re-sends the weights whatever the version; level 1 moves the
  weights to host memory and drops the cache. Before generating, the weights are woken (and re-sent when
  dropped or stale), then the KV cache.
- Sampling: :mod:`~lit_memtrain.models.generation.vllm_common` (same meaning as Hugging Face ``generate``).

Not implemented: tensor parallelism of the engine, TRL's importance-sampling correction of vLLM's sampling
probabilities (``vllm_importance_sampling_correction``; here the loss treats vLLM's completions as drawn from the
trained policy, TRL's behaviour with that option off).
"""

from __future__ import annotations

import copy
import os
import socket
import tempfile
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lit_memtrain.models.generation.backend import GenerationBackend
from lit_memtrain.models.generation.sampling import SamplingSettings
from lit_memtrain.models.generation.vllm_common import (
    check_vllm_sampling,
    checked_completions,
    require_vllm,
    vllm_requests,
    vllm_sampling_params,
)
from lit_memtrain.models.generation.weight_sync import inference_weights, materialized

__all__ = ["VLLMColocate"]

# vLLM's memory profiler sizes activations for max_num_batched_tokens; its large default leaves no room (TRL's value).
_MAX_NUM_BATCHED_TOKENS = 4096


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _launcher_environment() -> int:
    """Set what vLLM's ``external_launcher`` reads (the torch.distributed rank and world, a rendezvous address when
    none is set, as TRL does); return this process's rank."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    local_rank = int(os.environ.get("LOCAL_RANK", rank % max(1, torch.cuda.device_count())))
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world))
    os.environ.setdefault("MASTER_ADDR", "localhost")
    if os.environ.get("MASTER_PORT", "").strip().lower() in ("", "0", "auto"):
        os.environ["MASTER_PORT"] = str(_free_port())
    return rank


def engine_config_directory(model: nn.Module, directory: str) -> str:
    """Write the config a separate engine builds ``model``'s architecture from (the base model's, LoRA merged
    changes no shape) into ``directory``, with ``architectures`` named (a model built from a config has none)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = copy.deepcopy(base.config)
    config.architectures = [type(base).__name__]
    config.save_pretrained(directory)
    return directory


class VLLMColocate(GenerationBackend):
    """Completions from a vLLM engine in this process, its weights synced from the trained model.

    Args:
        sampling, eos_token_ids, pad_token_id: see :class:`~lit_memtrain.models.generation.backend.GenerationBackend`.
        gpu_memory_utilization: the share of the GPU's memory vLLM may take for its weights and KV cache (TRL's
            colocate default, 0.3: the rest is training's).
        sleep_level: 2 (drop weights and KV cache between generations, TRL's), 1 (weights to host memory, KV cache
            dropped) or None (no sleep mode: both stay on the GPU).
        max_model_len: the longest prompt + completion the engine serves (None: the model config's).
        max_num_seqs: sequences the engine runs at once (None: vLLM's default).
        dtype: the engine's dtype (``"auto"``: the model config's; set ``"bfloat16"`` when training fp32 weights).
        enforce_eager: no CUDA graphs (less memory and start-up time, slower decoding).
        seed: the engine's seed; rank ``r`` uses ``seed + r``.

    Example:
        >>> GRPOModule(..., generation_backend="vllm_colocate",
        ...            generation_options={"gpu_memory_utilization": 0.4, "max_model_len": 2048})  # doctest: +SKIP
    """

    def __init__(
        self,
        sampling: SamplingSettings,
        eos_token_ids: Sequence[int],
        pad_token_id: int,
        gpu_memory_utilization: float = 0.3,
        sleep_level: int | None = 2,
        max_model_len: int | None = None,
        max_num_seqs: int | None = None,
        dtype: str = "auto",
        enforce_eager: bool = False,
        seed: int = 0,
    ) -> None:
        super().__init__(sampling, eos_token_ids, pad_token_id)
        require_vllm()
        check_vllm_sampling(sampling)
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}.")
        if sleep_level not in (None, 1, 2):
            raise ValueError(f"sleep_level must be 1, 2 or None (no sleep mode), got {sleep_level!r}.")
        for name, value in (("max_model_len", max_model_len), ("max_num_seqs", max_num_seqs)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an int >= 1 or None, got {value!r}.")
        self.options: dict[str, Any] = {
            "gpu_memory_utilization": gpu_memory_utilization, "max_model_len": max_model_len,
            "max_num_seqs": max_num_seqs, "dtype": dtype, "enforce_eager": enforce_eager,
        }  # fmt: skip
        self.sleep_level = sleep_level
        self.seed = seed
        self.llm: Any = None
        self._config_directory: tempfile.TemporaryDirectory | None = None
        self._weights_version: int | None = None
        self._weights_dropped = False

    @classmethod
    def check_available(cls) -> None:
        require_vllm()

    @classmethod
    def check_sampling(cls, sampling: SamplingSettings) -> None:
        check_vllm_sampling(sampling)

    def setup(self, model: nn.Module) -> None:
        """Build this rank's engine (random weights until the first generation sends the trained ones), asleep."""
        if self.llm is not None:
            return
        inference_weights(model)  # refuse a model whose weights cannot be sent, before starting an engine
        from vllm import LLM

        rank = _launcher_environment()
        self._config_directory = tempfile.TemporaryDirectory(prefix="lit-memtrain-vllm-")
        self.llm = LLM(
            model=engine_config_directory(model, self._config_directory.name), load_format="dummy",
            skip_tokenizer_init=True, tensor_parallel_size=1, distributed_executor_backend="external_launcher",
            enable_sleep_mode=self.sleep_level is not None, seed=self.seed + rank,
            logprobs_mode="processed_logprobs",  # after temperature and the logit processors, as the trainer's
            max_num_batched_tokens=_MAX_NUM_BATCHED_TOKENS, **self.options,
        )  # fmt: skip
        if self.sleep_level is not None:
            self.llm.sleep(level=2)  # nothing worth keeping yet
            self._weights_dropped = True

    def generate(
        self,
        model: nn.Module,
        prompt_ids: Sequence[Sequence[int]],
        num_generations: int,
        device: torch.device,
        weights_version: int,
    ) -> list[list[int]]:
        from vllm import SamplingParams

        if not prompt_ids:
            return []
        self.setup(model)
        prompts, n = vllm_requests(prompt_ids, num_generations, self.sampling)
        params = SamplingParams(**vllm_sampling_params(self.sampling, self.eos_token_ids, n), detokenize=False,
                                logprobs=0)  # the sampled tokens' log-probabilities (sampling_logprobs)  # fmt: skip
        self._load_weights(model, device, weights_version)
        if self.sleep_level is not None:
            self.llm.wake_up(tags=["kv_cache"])
        try:
            outputs = self.llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
        finally:
            if self.sleep_level is not None:
                self.llm.sleep(level=self.sleep_level)
                self._weights_dropped = self.sleep_level == 2
        samples = [o for output in outputs for o in sorted(output.outputs, key=lambda o: o.index)]
        completions = checked_completions(
            [list(o.token_ids) for o in samples], len(prompt_ids) * num_generations, self.eos_token_ids,
            self.sampling.max_completion_length, "vLLM (colocate)",
        )  # fmt: skip
        self.sampling_logprobs = [
            [entries[token].logprob for token, entries in zip(kept, sample.logprobs)]
            for kept, sample in zip(completions, samples)
        ]
        return completions

    def _load_weights(self, model: nn.Module, device: torch.device, weights_version: int) -> None:
        """Wake the engine's weights and send the trained ones if they changed or were dropped while asleep."""
        if self.sleep_level is not None:
            if torch.cuda.is_available():
                torch.cuda.empty_cache()  # room for the engine's weights (TRL does the same)
            self.llm.wake_up(tags=["weights"])
        if weights_version == self._weights_version and not self._weights_dropped:
            return
        engine_model = self.llm.llm_engine.model_executor.driver_worker.model_runner.model
        for name, tensor in materialized(inference_weights(model), device):  # one tensor at a time
            engine_model.load_weights([(name, tensor)])
        self.llm.reset_prefix_cache()
        self._weights_version, self._weights_dropped = weights_version, False
