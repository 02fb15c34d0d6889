"""Checks a context-parallel set-up must pass before any work: the methods, the group size, the head counts.

Why up front: a bad size otherwise surfaces deep inside the first forward, as an all-to-all that hangs or a
reshape error on one rank while the others wait in a collective. These checks read only integers (the model
config and the sizes), so a strategy calls them in its set-up, before any process group or collective exists,
and the error names the sizes that would work.

Ulysses moves whole heads between ranks: each of the ``cp`` ranks attends with ``q_heads / cp`` query heads
over the full sequence, so ``q_heads % cp == 0``. Key/value heads travel the same way when ``kv_heads % cp ==
0``; with fewer key/value heads than ranks (``cp % kv_heads == 0``) each is replicated ``cp / kv_heads`` times
first, so that every rank still holds the key/value head of its query heads. Ring attention splits only the
sequence, so any size works for it (the row is padded to a multiple of ``2 * cp``).
"""

from __future__ import annotations

from typing import Any, Literal

from lit_memtrain.parallel.dims import ParallelDims

Method = Literal["ulysses", "ring"]
METHODS: tuple[str, ...] = ("ulysses", "ring")

__all__ = ["METHODS", "Method", "check_context_parallel", "ulysses_sizes"]


def ulysses_sizes(num_attention_heads: int, num_key_value_heads: int) -> list[int]:
    """Every context-parallel size Ulysses supports for these head counts, ascending."""
    return [
        size
        for size in range(1, num_attention_heads + 1)
        if num_attention_heads % size == 0 and (num_key_value_heads % size == 0 or size % num_key_value_heads == 0)
    ]


def _head_counts(config: Any) -> tuple[int, int]:
    text = getattr(config, "get_text_config", lambda: config)()
    heads = getattr(text, "num_attention_heads", None)
    if not isinstance(heads, int) or heads < 1:
        raise ValueError(
            f"{type(config).__name__} has no num_attention_heads; context parallelism needs to know the model's heads."
        )
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    if heads % kv_heads:
        raise ValueError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}.")
    return heads, kv_heads


def check_context_parallel(
    config: Any, context_parallel_size: int, method: str, world_size: int | None = None
) -> None:
    """Raise ``ValueError`` unless ``method`` can split this model's attention over ``context_parallel_size`` ranks.

    Args:
        config: the model's ``transformers`` config (``num_attention_heads``, ``num_key_value_heads`` are read).
        context_parallel_size: ranks that share one sequence.
        method: ``"ulysses"`` or ``"ring"``.
        world_size: when given, it must be a multiple of ``context_parallel_size`` (the rest is data parallel;
            checked by :class:`~lit_memtrain.parallel.dims.ParallelDims`).

    Example:
        >>> from lit_memtrain.models.presets import build_config
        >>> check_context_parallel(build_config("tiny-qwen3"), 2, "ulysses")  # 4 query heads, 2 key/value heads
        >>> ulysses_sizes(4, 2)  # sizes 3 and 8 would raise, naming these
        [1, 2, 4]
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(map(repr, METHODS))}, got {method!r}.")
    size = context_parallel_size
    if world_size is None:
        ParallelDims.check_sizes(context_parallel_size=size)
    else:
        ParallelDims(world_size, context_parallel_size=size)
    heads, kv_heads = _head_counts(config)
    if method == "ulysses" and size not in ulysses_sizes(heads, kv_heads):
        raise ValueError(
            f"method='ulysses' with context_parallel_size={size} needs num_attention_heads ({heads}) divisible by "
            f"{size} and num_key_value_heads ({kv_heads}) divisible by {size} or dividing it. Sizes that work for this "
            f"model: {ulysses_sizes(heads, kv_heads)}; method='ring' works with any size."
        )
