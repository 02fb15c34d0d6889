"""Module paths of lit-memtrain before its layout by role (0.1), and where each now lives.

Why: configs name classes by import path (``class_path: lit_memtrain.optim.PagedAdamW8bit``) and checkpoints
name the module that wrote them (``lit_memtrain.module.CausalLMModule``). Importing an old path keeps working:
it gives the module at the new path (one object, not a copy) and warns once with the path to write instead.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

__all__ = ["MOVED_MODULES", "current_path", "install"]

MOVED_MODULES: dict[str, str] = {
    "lit_memtrain.allocator": "lit_memtrain.techniques.allocator",
    "lit_memtrain.attention": "lit_memtrain.techniques.attention",
    "lit_memtrain.autocast": "lit_memtrain.techniques.autocast",
    "lit_memtrain.checkpointing": "lit_memtrain.techniques.checkpointing",
    "lit_memtrain.loss": "lit_memtrain.techniques.loss",
    "lit_memtrain.logprobs": "lit_memtrain.techniques.logprobs",
    "lit_memtrain.memory_timeline": "lit_memtrain.techniques.memory_timeline",
    "lit_memtrain.offload": "lit_memtrain.techniques.offload",
    "lit_memtrain.rms_norm": "lit_memtrain.techniques.rms_norm",
    "lit_memtrain.tiled_mlp": "lit_memtrain.techniques.tiled_mlp",
    "lit_memtrain.layers": "lit_memtrain.models.layers",
    "lit_memtrain.lora": "lit_memtrain.models.lora",
    "lit_memtrain.moe": "lit_memtrain.models.moe",
    "lit_memtrain.presets": "lit_memtrain.models.presets",
    "lit_memtrain.model_builder": "lit_memtrain.models.builder",
    "lit_memtrain.generate": "lit_memtrain.models.generate",
    "lit_memtrain.probes": "lit_memtrain.objectives.probes",
    "lit_memtrain.tokenizer": "lit_memtrain.datamodules.tokenizer",
    "lit_memtrain.module": "lit_memtrain.objectives.causal_lm",
    "lit_memtrain.dpo": "lit_memtrain.objectives.dpo",
    "lit_memtrain.preference_loss": "lit_memtrain.objectives.preference_loss",
    "lit_memtrain.optim": "lit_memtrain.objectives.optim",
    "lit_memtrain.step_tokens": "lit_memtrain.objectives.step_tokens",
    "lit_memtrain.throughput": "lit_memtrain.objectives.throughput",
    "lit_memtrain.context_parallel": "lit_memtrain.parallel.context_parallel",
    "lit_memtrain.strategies.parallelize": "lit_memtrain.parallel.fsdp",
}


def current_path(path: str) -> str:
    """``path`` (a module, or a module and a name in it) with an old module prefix replaced by the new one."""
    for old, new in MOVED_MODULES.items():
        if path == old or path.startswith(f"{old}."):
            return new + path[len(old) :]
    return path


class _MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old module path and loads it as the module at its new path."""

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if current_path(fullname) == fullname:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        new = current_path(spec.name)
        warnings.warn(f"{spec.name} moved to {new}; import it from there.", FutureWarning, stacklevel=2)
        return importlib.import_module(new)

    def exec_module(self, module: ModuleType) -> None:
        sys.modules[module.__name__] = module  # the new path's module, under its own name too


def install() -> None:
    """Let old module paths import (once per process)."""
    if not any(isinstance(finder, _MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _MovedModuleFinder())  # before the path finder, which would load a second copy
