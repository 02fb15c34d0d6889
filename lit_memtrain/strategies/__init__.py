"""lit-memtrain strategies: FSDP2 sharding (with host offload) on Lightning's ModelParallelStrategy."""

from lit_memtrain.strategies.fsdp2 import FSDP2Strategy

__all__ = ["FSDP2Strategy"]
