"""Loading fit checkpoints (single files and distributed ones) and naming the module class that wrote them.

Why the class is resolved by its import path and not imported here: the checkpoint says which lit-memtrain module
wrote it (``checkpoint["lit_memtrain"]["module_class"]``), and importing the objectives here would tie this file to
every one of them. Loading uses ``weights_only=True``: a checkpoint runs no code while it loads.
"""

from __future__ import annotations

import importlib
import pickle
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch import LightningModule

from lit_memtrain.moved import current_path

__all__ = ["lit_memtrain_class_path", "load_checkpoint"]

_CAUSAL_LM_MODULE = "lit_memtrain.objectives.causal_lm.CausalLMModule"  # what checkpoints that name none hold


def lit_memtrain_class_path(module_class: type) -> str:
    """The import path of the closest lit-memtrain class ``module_class`` derives from (a user's subclass is
    exported as the lit-memtrain module it extends)."""
    base = next(cls for cls in module_class.__mro__ if cls.__module__.startswith("lit_memtrain."))
    return f"{base.__module__}.{base.__qualname__}"


def load_checkpoint(path: str | Path, map_location: str = "cpu") -> LightningModule:
    """Load a checkpoint written by a fit, with ``weights_only=True``: tensors, plain values and this project's
    own hyper-parameter types only, so an untrusted checkpoint cannot run code while it loads.

    ``path`` is a ``.ckpt`` file, or the directory of a distributed checkpoint (written under
    :class:`~lit_memtrain.strategies.FSDP2Strategy`), whose every rank's shards are read into one whole model
    in this process.

    Raises:
        pickle.UnpicklingError: the checkpoint holds anything else, with what was found and what to do.
    """
    try:
        if Path(path).is_dir():
            return _load_distributed_checkpoint(Path(path))
        if Path(path).is_file():  # memory-mapped: reads no tensor data
            checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        else:  # a remote path (fsspec), as load_from_checkpoint takes it
            with get_filesystem(path).open(path, "rb") as file:
                checkpoint = torch.load(file, map_location="cpu", weights_only=True)
        module_class = _module_class(checkpoint)
        return module_class.load_from_checkpoint(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as error:
        found = next((line.strip() for line in str(error).splitlines() if "GLOBAL" in line or "global" in line), "")
        raise pickle.UnpicklingError(
            f"Refused to load {str(path)!r}: it holds Python objects other than tensors, plain values and "
            f"lit-memtrain's own settings ({found or str(error).splitlines()[0]}), which could run code while "
            "loading. Only checkpoints written by lit-memtrain load here; if you wrote this one yourself and trust "
            "it, load it in Python with CausalLMModule.load_from_checkpoint(path, weights_only=False)."
        ) from error


def _module_class(checkpoint: dict[str, Any]) -> type[LightningModule]:
    """The LightningModule class that wrote ``checkpoint`` (``CausalLMModule`` for checkpoints that do not say).

    Only this package's LightningModules (``CausalLMModule``, ``DPOModule``) are imported: the class is resolved from
    its import path, which old checkpoints give in the layout before 0.2 (``lit_memtrain.module.CausalLMModule``;
    :mod:`lit_memtrain.moved` maps it).
    """
    path = checkpoint.get("lit_memtrain", {}).get("module_class", _CAUSAL_LM_MODULE)
    module_name, _, class_name = current_path(path).rpartition(".")
    module_class = None
    if module_name.startswith("lit_memtrain."):
        try:
            module_class = getattr(importlib.import_module(module_name), class_name, None)
        except ImportError:
            module_class = None
    if not (isinstance(module_class, type) and issubclass(module_class, LightningModule)):
        raise ValueError(
            f"The checkpoint was written by {path!r}, which is not a lit-memtrain module; load it in Python with "
            "that class's load_from_checkpoint."
        )
    return module_class


def _load_distributed_checkpoint(path: Path) -> LightningModule:
    """The module of a distributed checkpoint (a directory of shards and ``meta.pt``), whole, in this process."""
    import torch.distributed.checkpoint as dcp

    metadata = torch.load(path / "meta.pt", map_location="cpu", weights_only=True)
    module = _module_class(metadata)(**metadata["hyper_parameters"])
    module.configure_model()
    state = {"state_dict": module.state_dict()}
    dcp.load(state, checkpoint_id=path, no_dist=True)  # reads the shards of every rank into the full tensors
    module.load_state_dict(state["state_dict"])
    return module
