"""Where ``lit-memtrain fit`` keeps checkpoints, and what ``--ckpt_path last`` resumes from.

Why not Lightning's own resolution of ``last``: a ``ModelCheckpoint`` without ``dirpath`` saves under the first
logger's name and version (``<save_dir>/<project>/<run-id>/checkpoints`` for W&B), and each launch of the same
command is a new W&B run, so ``last`` looked in a folder that did not exist yet and trained from step 0 without a
word. And ``last`` is the newest ``last*.ckpt`` file by time, which after a kill or a full disk is a partial file, or
an older state than the step checkpoint saved just before.

What is done instead: a ``ModelCheckpoint`` without ``dirpath`` saves in ``<first logger's save_dir, else
default_root_dir>/checkpoints``, the same folder at every launch (:func:`stable_checkpoint_folders`); ``last``
is the readable checkpoint there holding the highest step, of the run that saved last (an earlier run's
checkpoints left in the folder are not taken for this one's), a file that cannot be read being skipped with a line
that names it (:func:`resume_point`); a checkpoint made with another model or data configuration is refused
(:func:`check_same_configuration`); and a W&B logger continues the run the checkpoint recorded, under its id
(:func:`continued_loggers`). The fit's first line says what it resumes from, or that it
starts fresh and where it looked.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any, NamedTuple

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import WandbLogger

from lit_memtrain.callbacks.run_folder_lock import RunFolderLock
from lit_memtrain.objectives.checkpoint_files import (
    checkpoints_in,
    newest_readable,
    read_checkpoint,
    unreadable_reason,
)

__all__ = [
    "DATA_SETTINGS", "MODEL_SETTINGS", "ResumePoint", "check_same_configuration", "continued_loggers",
    "readable_checkpoint", "resume_point", "stable_checkpoint_folders",
]  # fmt: skip

# The settings that make a checkpoint's state another model's or another data order's when they change.
MODEL_SETTINGS = ("model", "preset", "config", "config_overrides", "model_init_kwargs", "lora")
DATA_SETTINGS = (
    "tokenizer", "dataset", "dataset_config", "data_files", "split", "max_length", "packing", "packing_strategy",
    "seed",
)  # fmt: skip


class ResumePoint(NamedTuple):
    """The checkpoint a fit resumes from (None: it starts fresh), its contents (None: left to Lightning), and the
    lines that say so."""

    path: str | None
    checkpoint: dict[str, Any] | None
    lines: list[str]
    warnings: list[str]


def stable_checkpoint_folders(trainer: Trainer) -> list[str]:
    """Give every ``ModelCheckpoint`` without ``dirpath`` the folder ``<save_dir>/checkpoints`` (the first logger's
    ``save_dir``, else the trainer's ``default_root_dir``); the folders of all of them."""
    root = str(next((logger.save_dir for logger in trainer.loggers[:1] if logger.save_dir), trainer.default_root_dir))
    folders = []
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint):
            if callback.dirpath is None:
                folder = f"{root.rstrip('/')}/checkpoints"
                callback.dirpath = folder if _is_remote(root) else os.path.realpath(folder)
            folders.append(str(callback.dirpath))
    return folders


def _is_remote(path: str) -> bool:
    return "://" in path


def resume_point(ckpt_path: str | None, folders: list[str]) -> ResumePoint:
    """What ``fit(ckpt_path=...)`` resumes from: ``"last"`` is the readable checkpoint in ``folders`` holding the
    highest step; a path must be a readable checkpoint. Remote folders and paths (``s3://``) are left to
    Lightning, which resolves ``last`` there as the newest ``last*.ckpt``.

    Raises:
        ValueError: ``ckpt_path`` names a checkpoint that cannot be read (why, and what to do).
    """
    where = ", ".join(folders) or "no checkpoint folder (checkpointing is off)"
    if ckpt_path is None:
        if not folders:
            return ResumePoint(None, None, ["Starting fresh; checkpointing is off, so this fit cannot be resumed"], [])
        line = f"Starting fresh (no --ckpt_path); checkpoints go to {where}, which --ckpt_path last resumes"
        return ResumePoint(None, None, [line], [])
    if _is_remote(str(ckpt_path)) or (ckpt_path == "last" and any(map(_is_remote, folders))):
        return ResumePoint(ckpt_path, None, [f"Resuming from {ckpt_path} as Lightning finds it in {where}"], [])
    if ckpt_path != "last":
        checkpoint = readable_checkpoint(ckpt_path)
        return ResumePoint(ckpt_path, checkpoint, [_resuming(ckpt_path, checkpoint)], [])
    found = newest_readable(checkpoints_in(folders), RunFolderLock.run_of)
    warnings = [f"Skipped checkpoint {path}: {reason}" for path, reason in found.skipped]
    if found.path is None:
        seen = f" ({len(found.skipped)} unreadable)" if found.skipped else ""
        return ResumePoint(None, None, [f"Starting fresh: no checkpoint to resume{seen} in {where}"], warnings)
    checkpoint = read_checkpoint(found.path)
    return ResumePoint(str(found.path), checkpoint, [_resuming(found.path, checkpoint)], warnings)


def readable_checkpoint(ckpt_path: str | Path) -> dict[str, Any]:
    """The checkpoint ``--ckpt_path`` names (tensors memory-mapped).

    Raises:
        ValueError: it is not there or cannot be read, in one line.
    """
    try:
        return read_checkpoint(ckpt_path)
    except FileNotFoundError:
        raise ValueError(f"--ckpt_path {ckpt_path}: no such checkpoint") from None
    except Exception as error:  # noqa: BLE001 -- any reason is the user's to hear, in one line
        raise ValueError(
            f"--ckpt_path {ckpt_path} cannot be read: {unreadable_reason(error)}. Give another checkpoint, or "
            "--ckpt_path last for the newest readable one."
        ) from None


def _resuming(path: str | Path, checkpoint: dict[str, Any]) -> str:
    return f"Resuming from {path} (step {checkpoint['global_step']})"


def check_same_configuration(path: str, checkpoint: dict[str, Any], module: Any, datamodule: Any) -> None:
    """Refuse to resume ``checkpoint`` into a module or datamodule whose defining settings differ from its own.

    Raises:
        ValueError: a setting of :data:`MODEL_SETTINGS` or :data:`DATA_SETTINGS` differs, naming it and both values.
    """
    pairs = (
        ("model", MODEL_SETTINGS, checkpoint.get("hyper_parameters"), getattr(module, "hparams", None)),
        ("data", DATA_SETTINGS, checkpoint.get("datamodule_hyper_parameters"), getattr(datamodule, "hparams", None)),
    )
    for kind, names, saved, current in pairs:
        if not saved or current is None:
            continue
        for name in names:
            if name in saved and name in current and saved[name] != current[name]:
                raise ValueError(
                    f"{path} was made with another {kind} configuration ({name}: {saved[name]!r} there, "
                    f"{current[name]!r} now); resume it with the same {kind} settings, or start this run in another "
                    "folder."
                )


def continued_loggers(configured: Any, loggers: list[Any], checkpoint: dict[str, Any]) -> list[Any] | None:
    """The loggers with each W&B logger rebuilt to continue the run ``checkpoint`` recorded (its id), or None when
    none is to change.

    ``configured`` is the parsed ``trainer.logger`` (one ``class_path``/``init_args`` or a list of them). A
    ``WandbLogger`` is rebuilt when the user gave it neither ``version`` nor ``id`` and the checkpoint recorded one
    for its place in the list. Other loggers start a version of their own: a ``CSVLogger`` given an existing
    version deletes the metrics it holds.
    """
    saved = (checkpoint.get("lit_memtrain") or {}).get("logger_versions") or []
    specs = configured if isinstance(configured, list) else [configured]
    if len(specs) != len(loggers) or not saved:
        return None
    rebuilt, changed = [], False
    for spec, logger, version in zip(specs, loggers, [*saved, *[None] * len(loggers)]):
        init_args = _init_args(spec)
        given_version = init_args is None or init_args.get("version") is not None or init_args.get("id") is not None
        if version is None or given_version or not isinstance(logger, WandbLogger):
            rebuilt.append(logger)
            continue
        module_name, _, class_name = spec["class_path"].rpartition(".")
        logger_class = getattr(importlib.import_module(module_name), class_name)
        given = {name: value for name, value in init_args.items() if value is not None}  # None: the default
        rebuilt.append(logger_class(**given, version=version))
        changed = True
    return rebuilt if changed else None


def _init_args(spec: Any) -> dict[str, Any] | None:
    """A parsed logger's arguments as a plain dict (None for a logger not given by class_path)."""
    if spec is None or isinstance(spec, bool) or "class_path" not in spec:
        return None
    init_args = spec.get("init_args")
    given = dict(init_args.as_dict() if hasattr(init_args, "as_dict") else init_args or {})
    return {**given, **dict(spec.get("dict_kwargs") or {})}  # dict_kwargs: what a **kwargs of the class took
