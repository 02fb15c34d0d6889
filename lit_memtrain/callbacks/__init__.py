"""Lightning callbacks, one memory technique or diagnostic each, and the guards of a fit's outputs.

The technique callbacks exported here describe themselves to the memory planner
(:class:`~lit_memtrain.callbacks.technique_description.PlannedTechnique`), which finds them in this list.
"""

from lit_memtrain.callbacks.activation_offloading import ActivationOffloading
from lit_memtrain.callbacks.allocator_settings import AllocatorSettings
from lit_memtrain.callbacks.chunked_rms_norm import ChunkedRMSNorm
from lit_memtrain.callbacks.compiled_layers import CompiledLayers
from lit_memtrain.callbacks.exact_answer_accuracy import ExactAnswerAccuracy
from lit_memtrain.callbacks.gradient_checkpointing import GradientCheckpointing
from lit_memtrain.callbacks.memory_bounded_throughput import MemoryBoundedThroughput
from lit_memtrain.callbacks.memory_monitor import MemoryMonitor
from lit_memtrain.callbacks.memory_plan_check import MemoryPlanCheck
from lit_memtrain.callbacks.output_preflight import OutputPreflight
from lit_memtrain.callbacks.positional_loss import PositionalLoss
from lit_memtrain.callbacks.run_folder_lock import RunFolderLock
from lit_memtrain.callbacks.sigterm_checkpoint import SigtermCheckpoint
from lit_memtrain.callbacks.technique_description import (
    CompareRow,
    PlannedTechnique,
    Suggestion,
    TechniqueDescription,
)
from lit_memtrain.callbacks.tiled_mlp import TiledMLP

__all__ = [
    "ActivationOffloading",
    "AllocatorSettings",
    "ChunkedRMSNorm",
    "CompareRow",
    "CompiledLayers",
    "ExactAnswerAccuracy",
    "GradientCheckpointing",
    "MemoryBoundedThroughput",
    "MemoryMonitor",
    "MemoryPlanCheck",
    "OutputPreflight",
    "PlannedTechnique",
    "PositionalLoss",
    "RunFolderLock",
    "SigtermCheckpoint",
    "Suggestion",
    "TechniqueDescription",
    "TiledMLP",
]
