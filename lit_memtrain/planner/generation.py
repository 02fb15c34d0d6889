"""The planner's online step (GRPO, RLOO, Online DPO): a generation phase beside the simulated training step.

Why its own phase: a GRPO step first generates ``P x G`` completions (``P`` prompts per rank, ``G =
num_generations``) without gradients, holding the training state (parameters, optimizer state, gradients when
they accumulate across batches) plus the generation's key-value cache, and only then trains on them. The training
part is an SFT-like step the planner already simulates exactly: ``P x G / steps_per_generation`` sequences of up
to ``max_prompt_length + max_completion_length`` tokens (one padding-free row, or right-padded rows), with every
configured technique (:func:`grpo_training_settings`). The generation part is counted here, per backend
(:func:`generation_bytes`):

- ``transformers`` (Hugging Face ``generate``): the KV cache of ``P x G`` rows of ``prompt + completion`` tokens
  (``2 x layers x kv_heads x head_dim`` values per token, in the compute dtype), one layer's cache more (the
  cache grows by concatenation), the prefill's largest transient (one layer's MLP on every prompt token) and the
  next-token logits (fp32); under FSDP2 the root's parameters gathered for the whole generation, and with
  ``gather_weights_for_generation`` the whole model (less this rank's shard);
- ``transformers_continuous``: the same cache rounded up to pages;
- ``vllm_colocate``: ``gpu_memory_utilization`` of the GPU (vLLM's weights and KV cache), awake only while it
  generates (sleep mode gives it back for training);
- ``vllm_server``: nothing on the training GPUs (the server has its own).

An Online DPO step (:class:`~lit_memtrain.objectives.online_dpo.OnlineDPOModule`) is the same with ``G = 2`` (a
pair per prompt, ``max_new_tokens`` each) trained in one slice of ``2 P`` sequences; its reference is always there.

A frozen reference copy (``beta != 0`` without LoRA) is held through both phases: its parameters are added to
each (sharded under FSDP2, on the host with ``cpu_offload``). The gradients are counted in the generation phase
(they are freed after each optimizer step, so this overstates it when they do not accumulate across batches).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

__all__ = ["GRPO_MODULES", "GenerationPlan", "generation_bytes", "grpo_training_settings", "with_generation"]

GRPO_MODULES = (
    "lit_memtrain.objectives.grpo.GRPOModule",
    "lit_memtrain.objectives.rloo.RLOOModule",
    "lit_memtrain.objectives.online_dpo.OnlineDPOModule",
)
"""The modules planned with a generation phase (the online methods: subclasses of OnlineRLModule)."""
_PROMPT_DATA = "lit_memtrain.datamodules.prompts.PromptDataModule"
_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class GenerationPlan:
    """What the generation phase of a GRPO step holds, as configured.

    Attributes:
        prompts: prompts per rank and batch (``data.batch_size``).
        num_generations: completions per prompt.
        max_prompt_length, max_completion_length: tokens of a prompt and of a completion at most.
        backend: the ``generation_backend`` name.
        gather_weights: ``gather_weights_for_generation`` (under FSDP2, the whole model gathered).
        gpu_memory_utilization: vLLM colocate's share of the GPU.
        page_size: continuous batching's page (tokens).
        frozen_reference: a frozen copy of the initial weights is held (``beta != 0`` without LoRA).
    """

    prompts: int
    num_generations: int
    max_prompt_length: int
    max_completion_length: int
    backend: str = "transformers"
    gather_weights: bool = True
    gpu_memory_utilization: float = 0.3
    page_size: int = 256
    frozen_reference: bool = False

    @property
    def completions(self) -> int:
        return self.prompts * self.num_generations

    def describe(self) -> str:
        return (
            f"{self.backend} generation of {self.prompts} prompts x {self.num_generations} completions "
            f"({self.max_prompt_length:,} + {self.max_completion_length:,} tokens)"
        )


def grpo_training_settings(
    module_class: str, model: dict[str, Any], data: dict[str, Any], base: dict[str, Any]
) -> tuple[dict[str, Any], GenerationPlan]:
    """The :class:`~lit_memtrain.planner.settings.PlanSettings` arguments of an online fit's training step and its
    :class:`GenerationPlan`, from the module's and the :class:`~lit_memtrain.datamodules.prompts.PromptDataModule`'s
    arguments (defaults filled in by the caller); ``base`` holds the arguments every plan shares (precision,
    callbacks, strategy, tokenizer).

    Raises:
        ValueError: a datamodule without ``max_prompt_length`` or ``batch_size``, or slices that do not divide.
    """
    from lit_memtrain.objectives.online_dpo import OnlineDPOModule
    from lit_memtrain.planner.settings import import_class

    module_type = import_class(module_class, "model.class_path")
    pairs = issubclass(module_type, OnlineDPOModule)  # two completions per prompt, trained in one slice
    module = {**{k: p.default for k, p in _defaults(module_type).items()}, **model}
    prompt_length, prompts = data.get("max_prompt_length"), data.get("batch_size")
    if not isinstance(prompt_length, int) or not isinstance(prompts, int):
        raise ValueError(
            f"{module_class.rsplit('.', 1)[-1]} is planned on {_PROMPT_DATA} batches with a max_prompt_length and a "
            f"batch_size; got max_prompt_length={prompt_length!r}, batch_size={prompts!r}. PromptDataModule tokenizes "
            "prompts whole by default (as TRL): set data.max_prompt_length to the longest prompt the plan must hold."
        )
    generations = 2 if pairs else int(module["num_generations"])
    slices = 1 if pairs else int(module.get("steps_per_generation") or module["gradient_accumulation_steps"])
    if (prompts * generations) % slices:
        raise ValueError(
            f"batch_size={prompts} x num_generations={generations} cannot be split into steps_per_generation={slices} "
            "slices (GRPOModule refuses it too)."
        )
    options = dict(module.get("generation_options") or {})
    backend = module["generation_backend"] if isinstance(module["generation_backend"], str) else "custom"
    plan = GenerationPlan(
        prompts=prompts, num_generations=generations, max_prompt_length=prompt_length,
        max_completion_length=int(module["max_new_tokens" if pairs else "max_completion_length"]), backend=backend,
        gather_weights=bool(options.get("gather_weights", module["gather_weights_for_generation"])),
        gpu_memory_utilization=float(options.get("gpu_memory_utilization", 0.3)),
        page_size=int(options.get("page_size", 256)),
        frozen_reference=(pairs or float(module["beta"]) != 0) and module.get("lora") is None,
    )  # fmt: skip
    from lit_memtrain.planner.settings import CAUSAL_LM_MODULE, init_parameters
    from lit_memtrain.objectives.causal_lm import CausalLMModule

    accepted = init_parameters(CausalLMModule)
    training = {
        **base,
        "module": {name: value for name, value in model.items() if name in accepted},
        "max_length": prompt_length + plan.max_completion_length,
        "batch_size": plan.completions // slices,
        "padding_free": bool(module["padding_free"]),
        "accumulate_grad_batches": int(module["gradient_accumulation_steps"]),
        "module_class": CAUSAL_LM_MODULE,
        "generation": plan,
    }
    return training, plan


def _defaults(cls: type) -> dict[str, Any]:
    from lit_memtrain.planner.settings import init_parameters

    return {name: p for name, p in init_parameters(cls).items() if p.default is not p.empty}


def _compute_bytes(settings: Any, config: Any) -> int:
    """Bytes of one activation value while generating: the compute dtype (autocast's under mixed precision)."""
    precision = settings.precision
    if precision.startswith(("bf16", "16")):
        return 2
    dtype = str(settings.module.get("dtype") or "float32")
    return _BYTES.get(dtype, _BYTES.get(str(getattr(config, "torch_dtype", "float32")).removeprefix("torch."), 4))


def generation_bytes(settings: Any, plan: GenerationPlan, config: Any, parameters: int, gpu_bytes: int,
                     max_length: int | None = None) -> dict[str, int]:  # fmt: skip
    """The device bytes the generation phase adds to the training state, by kind (see the module docstring).

    ``max_length``: prompt + completion tokens of a sequence (default: the plan's); ``parameters``: the model's.
    """
    total = plan.max_prompt_length + plan.max_completion_length if max_length is None else max_length
    prompt = min(plan.max_prompt_length, total)
    world = settings.strategy.world_size if settings.strategy.kind in ("fsdp2", "context_parallel") else 1
    value = _compute_bytes(settings, config)
    parts: dict[str, int] = {}
    if plan.backend == "vllm_server":
        return parts
    if plan.backend == "vllm_colocate":
        return {"vllm_engine": int(plan.gpu_memory_utilization * gpu_bytes)}
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers = int(text.num_hidden_layers)
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    per_token_layer = 2 * kv_heads * head_dim * value
    tokens = total
    if plan.backend == "transformers_continuous":
        tokens = math.ceil(total / plan.page_size) * plan.page_size
    rows = plan.completions
    parts["kv_cache"] = rows * tokens * per_token_layer * layers + rows * tokens * per_token_layer
    intermediate = int(getattr(text, "intermediate_size", 4 * text.hidden_size))
    parts["prefill_transients"] = 3 * rows * prompt * intermediate * value
    parts["logits"] = rows * int(text.vocab_size) * 4 * 2
    if world > 1:
        root = int(text.vocab_size) * int(text.hidden_size) * (1 if getattr(text, "tie_word_embeddings", False) else 2)
        gathered = parameters if plan.gather_weights else root
        parts["gathered_weights"] = gathered * value * (world - 1) // world
    return parts


def with_generation(step: Any, settings: Any, gpu_bytes: int) -> Any:
    """``step`` (the simulated training step of a GRPO fit) with the generation phase: its peak is the larger of
    the training peak and the training state plus :func:`generation_bytes`, its phase and breakdown that
    phase's, and a frozen reference's parameters added to both."""
    from lit_memtrain.models.builder import ModelRecipe, causal_lm_config

    plan: GenerationPlan = settings.generation
    shape = ("model", "preset", "config", "config_overrides", "model_init_kwargs", "trust_remote_code")
    recipe = ModelRecipe(**{k: v for k, v in settings.module.items() if k in shape and v is not None})
    config = causal_lm_config(recipe, local_files_only=True)
    memory = step.memory
    world = settings.strategy.world_size if settings.strategy.kind in ("fsdp2", "context_parallel") else 1
    reference = 0
    if plan.frozen_reference and not settings.strategy.cpu_offload:
        weight_bytes = _BYTES.get(str(settings.module.get("dtype") or "float32"), 4)
        reference = step.parameters * weight_bytes // world
    generation = generation_bytes(settings, plan, config, step.parameters, gpu_bytes, step.max_length)
    generation_peak = memory.fixed + reference + sum(generation.values())
    training_peak = memory.device_peak + reference
    notes = [
        f"Online RL: {plan.describe()} before training on {settings.batch_size} completions per slice; generation adds "
        + ", ".join(f"{kind} {size / 2**30:,.2f} GiB" for kind, size in generation.items())
        + (f"; the frozen reference holds {reference / 2**30:,.2f} GiB in both phases" if reference else "")
        + " (the training state in the generation phase includes the gradients: an upper bound).",
    ]
    notes.append(
        f"Online RL phases: training {training_peak / 2**30:,.2f} GiB (in {memory.phase}), generation "
        f"{generation_peak / 2**30:,.2f} GiB; the plan's peak is the larger."
    )
    if generation_peak > training_peak:
        weight_bytes = _BYTES.get(str(settings.module.get("dtype") or "float32"), 4)
        parameters = min(memory.fixed, step.parameters * weight_bytes // world)
        gradients = min(memory.fixed - parameters, step.trainable_parameters * weight_bytes // world)
        at_peak = {"parameters": parameters, "gradients": gradients,
                   "optimizer_state": memory.fixed - parameters - gradients, **generation}  # fmt: skip
        if reference:
            at_peak["reference"] = reference
        memory = dataclasses.replace(memory, device_peak=generation_peak, device_at_peak=at_peak,
                                     phase=f"generation ({plan.backend})")  # fmt: skip
    else:
        memory = dataclasses.replace(memory, device_peak=training_peak)
    return dataclasses.replace(step, memory=memory, notes=(*step.notes, *notes))
