"""The tests' tiny Qwen3-architecture model: its size, and a saved copy with the embedded tokenizer's vocabulary.

Why here: a test that compares two computations of one model (ours against TRL's, padding-free against padded)
needs the same small weights on both sides, loaded from a directory as a user's model is.

Example:
    >>> directory = save_tiny_causal_lm(tmp_path / "model", tokenizer)  # doctest: +SKIP
"""

from __future__ import annotations

from pathlib import Path

import torch

from lit_memtrain.models.presets import build_config

TINY_OVERRIDES = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "head_dim": 16}
"""``tiny-qwen3`` at the size every equivalence test can afford: 2 layers, hidden 64."""


def save_tiny_causal_lm(directory: Path, tokenizer, seed: int = 0) -> str:
    """A random tiny ``tiny-qwen3`` causal LM (seeded) saved in ``directory`` with ``tokenizer``'s vocabulary size."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = build_config("tiny-qwen3", {**TINY_OVERRIDES, "vocab_size": len(tokenizer)})
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return str(directory)
