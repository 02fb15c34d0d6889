"""Sizes and head counts are checked from the config alone, before any process group or collective exists."""

from __future__ import annotations

import pytest

from lit_memtrain.parallel.context_parallel import check_context_parallel, ulysses_sizes
from lit_memtrain.models.presets import build_config


def test_ulysses_sizes_follow_the_head_counts() -> None:
    assert ulysses_sizes(32, 8) == [1, 2, 4, 8, 16, 32]  # Qwen3-8B: kv heads replicated beyond 8
    assert ulysses_sizes(4, 2) == [1, 2, 4]
    assert ulysses_sizes(12, 8) == [1, 2, 4]  # 12 heads: no 8; 8 kv heads: no 3 or 6 (neither divides the other)


def test_ulysses_refuses_sizes_the_heads_cannot_split_and_names_those_that_work() -> None:
    config = build_config("tiny-qwen3")  # 4 query heads, 2 key/value heads
    check_context_parallel(config, 4, "ulysses", world_size=8)
    with pytest.raises(ValueError) as error:
        check_context_parallel(config, 3, "ulysses")
    assert str(error.value) == (
        "method='ulysses' with context_parallel_size=3 needs num_attention_heads (4) divisible by 3 and "
        "num_key_value_heads (2) divisible by 3 or dividing it. Sizes that work for this model: [1, 2, 4]; "
        "method='ring' works with any size."
    )
    check_context_parallel(config, 3, "ring")


def test_group_size_must_divide_the_world_and_be_positive() -> None:
    config = build_config("tiny-qwen3")
    with pytest.raises(ValueError, match=r"context_parallel_size=4 does not divide the world size 6.*\[1, 2, 3, 6\]"):
        check_context_parallel(config, 4, "ring", world_size=6)
    with pytest.raises(ValueError, match="positive int, got 0"):
        check_context_parallel(config, 0, "ring")
    with pytest.raises(ValueError, match="method must be one of 'ulysses', 'ring', got 'tree'"):
        check_context_parallel(config, 2, "tree")
