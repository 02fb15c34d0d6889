"""lit-memtrain strategies: FSDP2 sharding (with host offload) on Lightning's ModelParallelStrategy, and context
parallelism (one sequence split over several ranks) on top of it."""

from lit_memtrain.strategies.context_parallel import ContextParallelStrategy
from lit_memtrain.strategies.fsdp2 import FSDP2Strategy

__all__ = ["ContextParallelStrategy", "FSDP2Strategy"]
