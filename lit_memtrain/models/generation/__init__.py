"""Generation for online RL: the backend interface, the sampling settings, and the backends by name.

A backend is chosen by one argument (``GRPOModule(generation_backend=...)``); :data:`BACKENDS` maps each name to
its class: ``"transformers"`` (Hugging Face ``generate`` on the trained model, :class:`TransformersGenerate`),
``"transformers_continuous"`` (transformers' continuous batching, :class:`TransformersContinuousBatching`),
``"vllm_colocate"`` (a vLLM engine in the training process, asleep between generations, :class:`VLLMColocate`)
and ``"vllm_server"`` (a separately started ``vllm serve``, :class:`VLLMServer`). Every module here imports without
vLLM; the vLLM backends raise an ImportError saying what to install when they are chosen without it.
"""

from __future__ import annotations

from lit_memtrain.models.generation.backend import GenerationBackend, cut_after_eos
from lit_memtrain.models.generation.sampling import SamplingSettings
from lit_memtrain.models.generation.transformers_continuous import TransformersContinuousBatching
from lit_memtrain.models.generation.transformers_generate import TransformersGenerate
from lit_memtrain.models.generation.vllm_colocate import VLLMColocate
from lit_memtrain.models.generation.vllm_server import VLLMServer

__all__ = [
    "BACKENDS",
    "GenerationBackend",
    "SamplingSettings",
    "TransformersContinuousBatching",
    "TransformersGenerate",
    "VLLMColocate",
    "VLLMServer",
    "cut_after_eos",
]

BACKENDS: dict[str, type[GenerationBackend]] = {
    "transformers": TransformersGenerate,
    "transformers_continuous": TransformersContinuousBatching,
    "vllm_colocate": VLLMColocate,
    "vllm_server": VLLMServer,
}
"""Generation backends by the name ``generation_backend`` takes."""
