"""Building and loading the Hugging Face causal LM a module trains, and writing it back out.

Why apart from the training step: where and when the model is built depends on the strategy (on the
training device directly, or on the meta device and then sharded and loaded per rank), and an export
must rebuild exactly what was trained (a QLoRA base reloaded in a float dtype with the same constructor
options). Keeping these here leaves :mod:`lit_memtrain.module` with the training step only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

from lit_memtrain.lora import LoraSettings, check_quantization_available, merged_copy, quantization_config
from lit_memtrain.presets import PRESETS, build_config

__all__ = [
    "DTYPES",
    "ModelRecipe",
    "build_causal_lm",
    "causal_lm_config",
    "check_tokenizer_fits_model",
    "export_hf_directory",
    "reload_unquantized_base",
]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelRecipe:
    """Everything needed to build (and rebuild for export) the causal LM of a run.

    Exactly one of ``model`` (hub id or local path), ``preset`` (a :data:`~lit_memtrain.presets.PRESETS`
    name) or ``config`` (a dict with ``model_type``) is set. See :class:`~lit_memtrain.module.CausalLMModule`
    for the meaning of each field.
    """

    model: str | None = None
    preset: str | None = None
    config: dict[str, Any] | None = None
    config_overrides: dict[str, Any] | None = None
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"
    attn_implementation: str | None = "sdpa"  # None: transformers' default (sdpa where the model supports it)
    model_init_kwargs: dict[str, Any] = field(default_factory=dict)
    trust_remote_code: bool = False
    lora: LoraSettings | None = None

    def __post_init__(self) -> None:
        sources = [name for name in ("model", "preset", "config") if getattr(self, name)]
        if len(sources) != 1:
            raise ValueError(
                f"Give exactly one of model (hub id or path), preset (one of lit_memtrain.PRESETS) or config "
                f"(a dict with model_type); got {sources or 'none'}."
            )
        if self.preset and self.preset not in PRESETS:
            raise ValueError(f"Unknown model preset {self.preset!r}. Known presets: {', '.join(sorted(PRESETS))}.")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {[*DTYPES, 'auto']}, got {self.dtype!r}.")
        if self.lora is not None and self.lora.quantize and not self.model:
            raise ValueError("QLoRA (lora.quantize) quantizes a checkpoint while loading it: give model=<hub id or path>.")
        if self.quantized:
            check_quantization_available(self.lora)

    @property
    def quantized(self) -> bool:
        return self.lora is not None and self.lora.quantize is not None


def build_causal_lm(recipe: ModelRecipe, tokenizer: PreTrainedTokenizerBase | None = None) -> PreTrainedModel:
    """Load ``recipe.model`` with ``from_pretrained``, or build random weights from a preset or config.

    A model built from a preset or config takes its vocabulary size and special token ids from ``tokenizer``
    unless ``config_overrides`` sets them. The model is built where the caller's device context puts it.
    """
    init_kwargs = dict(recipe.model_init_kwargs)
    dtype = "auto" if recipe.dtype == "auto" else DTYPES[recipe.dtype]
    common = {"attn_implementation": recipe.attn_implementation, "trust_remote_code": recipe.trust_remote_code}
    if recipe.model:
        if recipe.quantized:
            compute_dtype = torch.bfloat16 if dtype in ("auto", torch.float32) else dtype
            init_kwargs["quantization_config"] = quantization_config(recipe.lora, compute_dtype)
            # Quantized weights load straight onto a GPU: this process's own, not always cuda:0 under DDP.
            init_kwargs.setdefault("device_map", {"": int(os.environ.get("LOCAL_RANK", 0))})
        return AutoModelForCausalLM.from_pretrained(recipe.model, dtype=dtype, **common, **init_kwargs)
    model_config = causal_lm_config(recipe, tokenizer)
    return AutoModelForCausalLM.from_config(model_config, dtype=torch.float32 if dtype == "auto" else dtype, **common)


def causal_lm_config(
    recipe: ModelRecipe, tokenizer: PreTrainedTokenizerBase | None = None, local_files_only: bool = False
) -> PretrainedConfig:
    """The config of the model ``build_causal_lm`` builds, without building it or reading any weights.

    For ``recipe.model`` this reads ``config.json`` (a local directory, or the hub or, with
    ``local_files_only``, only its cache) with ``model_init_kwargs`` applied as ``from_pretrained`` applies
    them; for a preset or config dict it is the config ``build_causal_lm`` uses, vocabulary and special
    tokens taken from ``tokenizer`` unless overridden.
    """
    if recipe.model:
        return AutoConfig.from_pretrained(
            recipe.model,
            trust_remote_code=recipe.trust_remote_code,
            local_files_only=local_files_only,
            **recipe.model_init_kwargs,
        )
    overrides = dict(recipe.config_overrides or {})
    if tokenizer is not None:
        overrides.setdefault("vocab_size", len(tokenizer))
        for name in ("pad_token_id", "eos_token_id", "bos_token_id"):
            overrides.setdefault(name, getattr(tokenizer, name))
    overrides.update(recipe.model_init_kwargs)
    return build_config(recipe.preset or recipe.config, overrides)


def check_tokenizer_fits_model(
    model: nn.Module, tokenizer: PreTrainedTokenizerBase, tokenizer_name: str, recipe: ModelRecipe
) -> None:
    """Refuse a tokenizer whose ids would index past the model's embedding, or the demo tokenizer on a real model."""
    from lit_memtrain.datamodules.embedded import EMBEDDED

    rows = model.get_input_embeddings().num_embeddings
    if recipe.model and tokenizer_name == EMBEDDED and rows != len(tokenizer):
        raise ValueError(
            f"model={recipe.model!r} ({rows} embedding rows) is paired with the embedded demo tokenizer "
            f"({len(tokenizer)} tokens), which it was not trained with. Give the model's own "
            f"tokenizer (for example --data.tokenizer={recipe.model})."
        )
    if len(tokenizer) > rows:
        raise ValueError(
            f"Tokenizer {tokenizer_name!r} has {len(tokenizer)} tokens but the model's embedding has "
            f"only {rows} rows, so some token ids would index past it. Use the model's own tokenizer, or a "
            "vocab_size of at least the tokenizer's length."
        )


def reload_unquantized_base(recipe: ModelRecipe) -> PreTrainedModel:
    """The base of a QLoRA run reloaded in host memory, unquantized, with everything else it was built with:
    ``model_init_kwargs`` (YaRN ``rope_parameters``...), ``trust_remote_code`` and ``dtype`` (the one its
    unquantized weights had)."""
    init_kwargs = {k: v for k, v in recipe.model_init_kwargs.items() if k not in ("quantization_config", "device_map")}
    dtype = "auto" if recipe.dtype == "auto" else DTYPES[recipe.dtype]
    return AutoModelForCausalLM.from_pretrained(
        recipe.model, dtype=dtype, trust_remote_code=recipe.trust_remote_code, device_map={"": "cpu"}, **init_kwargs
    )


def export_hf_directory(
    model: nn.Module, recipe: ModelRecipe, directory: str | Path, tokenizer: PreTrainedTokenizerBase | None = None
) -> Path:
    """Write a Hugging Face directory (model with any adapter merged, and tokenizer) that ``from_pretrained`` loads.

    The config written is the trained model's, so constructor options (``model_init_kwargs`` such as YaRN) are
    kept. A LoRA adapter is merged in host memory (:func:`~lit_memtrain.lora.merged_copy`); a QLoRA adapter
    into the base reloaded unquantized (:func:`reload_unquantized_base`) rather than into its 4/8-bit weights.
    """
    directory = Path(directory)
    base = reload_unquantized_base(recipe) if recipe.quantized else None
    merged_copy(model, base).save_pretrained(directory)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    return directory
