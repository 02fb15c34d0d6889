"""Context parallelism in plain torch: one sequence split across the ranks of a group."""

from lit_memtrain.context_parallel.sharding import SequenceShard, ShardLayout, padded_length, shard_batch
from lit_memtrain.context_parallel.validation import METHODS, check_context_parallel, ulysses_sizes

__all__ = [
    "METHODS",
    "SequenceShard",
    "ShardLayout",
    "check_context_parallel",
    "padded_length",
    "shard_batch",
    "ulysses_sizes",
]
