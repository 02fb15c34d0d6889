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

__all__ = ["lit_memtrain_class_path", "load_checkpoint", "saved_vocabulary"]

_CAUSAL_LM_MODULE = "lit_memtrain.objectives.causal_lm.CausalLMModule"  # what checkpoints that name none hold
_EMBEDDING_SUFFIXES = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight")


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
        module_class = _module_class(checkpoint, path)
        shapes = {key: tensor.shape for key, tensor in checkpoint.get("state_dict", {}).items()}
        return module_class.load_from_checkpoint(
            path,
            map_location=map_location,
            weights_only=True,
            **saved_vocabulary(checkpoint.get("hyper_parameters") or {}, shapes),
        )
    except pickle.UnpicklingError as error:
        found = next((line.strip() for line in str(error).splitlines() if "GLOBAL" in line or "global" in line), "")
        raise pickle.UnpicklingError(
            f"Refused to load {str(path)!r}: it holds Python objects other than tensors, plain values and "
            f"lit-memtrain's own settings ({found or str(error).splitlines()[0]}), which could run code while "
            "loading. Only checkpoints written by lit-memtrain load here; if you wrote this one yourself and trust "
            "it, load it in Python with CausalLMModule.load_from_checkpoint(path, weights_only=False)."
        ) from error


def saved_vocabulary(hyper_parameters: dict[str, Any], shapes: dict[str, Any]) -> dict[str, Any]:
    """The ``config_overrides`` that rebuild a preset model at the vocabulary its checkpoint holds (``{}`` when the
    hyper-parameters already say it, or the model is not a preset's).

    Why: before 0.2 a model built from a preset took its tokenizer's vocabulary (384 rows for the embedded one); a
    preset now keeps its own (512 for ``tiny-qwen3``). The rows of the checkpoint's input embedding are what the
    model it holds was built with, so they win over the preset's.
    """
    overrides = dict(hyper_parameters.get("config_overrides") or {})
    if not hyper_parameters.get("preset") or "vocab_size" in overrides:
        return {}
    rows = next((shape[0] for key, shape in shapes.items() if key.endswith(_EMBEDDING_SUFFIXES) and shape), None)
    return {} if rows is None else {"config_overrides": {**overrides, "vocab_size": int(rows)}}


def _module_class(checkpoint: dict[str, Any], source: str | Path) -> type[LightningModule]:
    """The LightningModule class that wrote ``checkpoint`` (read from ``source``; ``CausalLMModule`` for early
    lit-memtrain checkpoints that do not say).

    Only this package's LightningModules (``CausalLMModule``, ``DPOModule``, ``RewardModule``...) are imported: the
    class is resolved from its import path, which old checkpoints give in the layout before 0.2
    (``lit_memtrain.module.CausalLMModule``; :mod:`lit_memtrain.moved` maps it). A checkpoint that names no class
    must hold a model source (``model``, ``preset`` or ``config``) among its hyper-parameters, as every
    ``CausalLMModule`` does: another module's (a plain Lightning checkpoint) is refused by name rather than loaded
    into the wrong class.
    """
    if "lit_memtrain" not in checkpoint:
        hyper_parameters = checkpoint.get("hyper_parameters") or {}
        if not any(hyper_parameters.get(name) for name in ("model", "preset", "config")):
            raise ValueError(
                f"{str(source)!r} is not a lit-memtrain checkpoint: it names no lit-memtrain module (no 'lit_memtrain' "
                f"section) and its hyper-parameters ({', '.join(sorted(hyper_parameters)) or 'none'}) give no model, "
                "preset or config. Export it with the code that wrote it."
            )
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
    stored = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    shapes = {key.removeprefix("state_dict."): getattr(entry, "size", ()) for key, entry in stored.items()}
    hyper_parameters = metadata["hyper_parameters"]
    module = _module_class(metadata, path)(**{**hyper_parameters, **saved_vocabulary(hyper_parameters, shapes)})
    module.configure_model()
    state = {"state_dict": module.state_dict()}
    dcp.load(state, checkpoint_id=path, no_dist=True)  # reads the shards of every rank into the full tensors
    module.load_state_dict(state["state_dict"])
    return module
