"""Named model shapes for building a causal LM with random weights from a config.

Why: tests, the quickstart and the memory planner need real architectures without downloading
weights. A preset is the published shape of a model family member (or a tiny one for tests), its
vocabulary included: a run that reads another tokenizer keeps it (the tokenizer must fit inside it, see
:func:`~lit_memtrain.models.builder.causal_lm_config`), since the LM head is a large part of a model's memory.
``build_config`` turns a preset plus overrides into a ``transformers`` config.
"""

from __future__ import annotations

from typing import Any

from transformers import AutoConfig, PretrainedConfig

_QWEN3_COMMON: dict[str, Any] = {
    "model_type": "qwen3",
    "vocab_size": 151936,
    "head_dim": 128,
    "num_key_value_heads": 8,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
    "hidden_act": "silu",
}

PRESETS: dict[str, dict[str, Any]] = {
    "tiny-qwen3": {
        **_QWEN3_COMMON,
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "tie_word_embeddings": True,
    },
    "tiny-llama": {
        "model_type": "llama",
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 160,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 500_000.0},
        "tie_word_embeddings": False,
    },
    "qwen3-0.6b": {
        **_QWEN3_COMMON,
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "tie_word_embeddings": True,
    },
    "qwen3-1.7b": {
        **_QWEN3_COMMON,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "tie_word_embeddings": True,
    },
    "qwen3-4b": {
        **_QWEN3_COMMON,
        "hidden_size": 2560,
        "intermediate_size": 9728,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "tie_word_embeddings": True,
    },
    "qwen3-8b": {
        **_QWEN3_COMMON,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "tie_word_embeddings": False,
    },
    "llama-3.1-8b": {
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 500_000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "tie_word_embeddings": False,
    },
}


def build_config(preset: str | dict[str, Any], overrides: dict[str, Any] | None = None) -> PretrainedConfig:
    """Return a ``transformers`` config for a preset name or a config dict, with ``overrides`` applied.

    A dict must name its architecture with ``model_type`` (for example ``"qwen3"``).

    Example:
        >>> cfg = build_config("tiny-qwen3", {"num_hidden_layers": 1})
        >>> cfg.num_hidden_layers
        1
    """
    if isinstance(preset, str):
        if preset not in PRESETS:
            raise ValueError(f"Unknown model preset {preset!r}. Known presets: {', '.join(sorted(PRESETS))}.")
        values = dict(PRESETS[preset])
    else:
        values = dict(preset)
    values.update(overrides or {})
    model_type = values.pop("model_type", None)
    if model_type is None:
        raise ValueError(
            f"A model config dict needs a 'model_type' key (for example 'qwen3' or 'llama'); got keys {sorted(values)}."
        )
    return AutoConfig.for_model(model_type, **values)
