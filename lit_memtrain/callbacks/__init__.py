"""Lightning callbacks, one memory technique or diagnostic each."""

from lit_memtrain.callbacks.activation_offloading import ActivationOffloading
from lit_memtrain.callbacks.allocator_settings import AllocatorSettings
from lit_memtrain.callbacks.chunked_rms_norm import ChunkedRMSNorm
from lit_memtrain.callbacks.gradient_checkpointing import GradientCheckpointing
from lit_memtrain.callbacks.memory_bounded_throughput import MemoryBoundedThroughput
from lit_memtrain.callbacks.memory_monitor import MemoryMonitor
from lit_memtrain.callbacks.memory_plan_check import MemoryPlanCheck
from lit_memtrain.callbacks.positional_loss import PositionalLoss
from lit_memtrain.callbacks.tiled_mlp import TiledMLP

__all__ = [
    "ActivationOffloading",
    "AllocatorSettings",
    "ChunkedRMSNorm",
    "GradientCheckpointing",
    "MemoryBoundedThroughput",
    "MemoryMonitor",
    "MemoryPlanCheck",
    "PositionalLoss",
    "TiledMLP",
]
