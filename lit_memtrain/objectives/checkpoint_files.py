"""Checkpoint files on disk: written beside their final name and renamed into place, and found again at resume.

Why beside the destination: Lightning's ``TorchCheckpointIO`` writes through an fsspec transaction, which puts the
temporary in ``$TMPDIR`` and then *moves* it. On another filesystem the move is a copy into the final name, so a kill
during it leaves a partial ``last.ckpt`` where the previous good one was; on the same filesystem each kill leaves an
orphaned temporary in ``$TMPDIR``. A temporary in the destination's own folder is renamed into place, which POSIX
makes atomic: the final name holds the old file or the new one, never part of one. A temporary a kill left behind
is found by its name (:func:`remove_partials`) when the folder's next run starts.

Why resume reads the checkpoints themselves: the newest file is not the newest state (a truncated file left by a
full disk is the newest file, and ``last.ckpt`` is rewritten after the step checkpoint it copies). A checkpoint is
chosen by the step it holds, among those that can be read (:func:`newest_readable`).
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO, Any, NamedTuple

import torch

from lit_memtrain.models.folder_write import PARTIAL_MARK

__all__ = [
    "Found", "checkpoints_in", "is_partial", "newest_readable", "read_checkpoint", "remove_partials",
    "save_to_first_writable", "unreadable_reason", "write_beside",
]  # fmt: skip

_DISTRIBUTED_FILES = (".metadata", "meta.pt")  # what a distributed checkpoint's folder holds once complete


class Found(NamedTuple):
    """The checkpoint to resume from (None: none can be read), its step, and the files skipped with the reason."""

    path: Path | None
    step: int
    skipped: list[tuple[Path, str]]


def is_partial(path: str | Path) -> bool:
    """Whether ``path`` is a temporary :func:`write_beside` writes (``.<name>.partial-<pid>``)."""
    name = Path(path).name
    return name.startswith(".") and PARTIAL_MARK in name


def write_beside(path: str | Path, write: Callable[[IO[bytes]], Any]) -> None:
    """Call ``write(file)`` on a temporary in ``path``'s folder, flush it to disk and rename it to ``path``.

    A failure (a full disk, a kill) leaves whatever ``path`` held before; the temporary is removed, except after a
    kill (:func:`remove_partials` removes it at the next start).

    Raises:
        OSError: writing or renaming failed, with the errno of the cause, naming ``path`` and saying it is unchanged.
    """
    path = Path(path)
    partial = path.with_name(f".{path.name}{PARTIAL_MARK}{os.getpid()}")
    try:
        with open(partial, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(partial, path)
    except BaseException as error:
        partial.unlink(missing_ok=True)
        if not isinstance(error, OSError):
            raise
        reason = "the disk is full" if error.errno == errno.ENOSPC else (error.strerror or str(error))
        raise OSError(
            error.errno, f"Could not write {path} ({reason}); the file under that name, if any, is unchanged"
        ) from error
    _sync_folder(path.parent)


def save_to_first_writable(
    checkpoint: dict[str, Any], name: str, folders: Iterable[str | Path]
) -> tuple[Path | None, list[str]]:
    """Save ``checkpoint`` as ``name`` in the first of ``folders`` where it can be written; the path (None if in
    none) and why each folder tried before failed."""
    failures = []
    for folder in map(Path, folders):
        try:
            folder.mkdir(parents=True, exist_ok=True)
            write_beside(folder / name, lambda file: torch.save(checkpoint, file))
        except OSError as error:
            failures.append(f"{folder}: {error.strerror or error}")
            continue
        return folder / name, failures
    return None, failures


def remove_partials(folder: str | Path) -> list[Path]:
    """Remove the temporaries that killed writes left in ``folder``; the removed paths."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    removed = [path for path in folder.iterdir() if is_partial(path)]
    for path in removed:
        if path.is_dir():  # a distributed checkpoint's folder (FSDP2Strategy writes it beside, then renames)
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    return removed


def read_checkpoint(path: str | Path) -> dict[str, Any]:
    """A checkpoint's contents, its tensors memory-mapped rather than read (a ``.ckpt`` file, or the ``meta.pt``
    of a distributed checkpoint's folder: its step and settings, without the shards).

    Raises:
        Exception: the checkpoint cannot be read (truncated, empty, not a checkpoint); the message says why.
    """
    path = Path(path)
    if path.is_dir():
        missing = [name for name in _DISTRIBUTED_FILES if not (path / name).is_file()]
        if missing:
            raise ValueError(f"an incomplete distributed checkpoint (no {', '.join(missing)})")
        path = path / "meta.pt"
    if path.stat().st_size == 0:
        raise ValueError("an empty file")
    checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)  # reads no tensor data
    if not isinstance(checkpoint, dict) or "global_step" not in checkpoint:
        raise ValueError("not a Lightning checkpoint (no global_step)")
    return checkpoint


def checkpoints_in(folders: Iterable[str | Path]) -> list[Path]:
    """The checkpoints in ``folders``: ``.ckpt`` files, and folders named so (distributed checkpoints)."""
    return sorted(
        path
        for folder in map(Path, folders)
        if folder.is_dir()
        for path in folder.iterdir()
        if path.suffix == ".ckpt" and not is_partial(path)
    )


def newest_readable(
    candidates: Iterable[str | Path], run_of: Callable[[dict[str, Any]], Any] = lambda checkpoint: None
) -> Found:
    """The readable checkpoint among ``candidates`` that holds the highest step (the newest file among equals), of
    the run that wrote the newest readable file when ``run_of`` tells the checkpoints' runs apart.

    Why by run: a fit started afresh in a folder that holds an earlier run's checkpoints writes beside them
    (``last-v1.ckpt``), at lower steps; the highest step there is the earlier run's.
    """
    readable: list[tuple[Any, int, float, Path]] = []
    skipped = []
    for path in sorted({Path(candidate) for candidate in candidates}):
        try:
            checkpoint = read_checkpoint(path)
        except Exception as error:  # noqa: BLE001 -- any reason to be unreadable skips the file, and is reported
            skipped.append((path, unreadable_reason(error)))
            continue
        readable.append((run_of(checkpoint), int(checkpoint["global_step"]), path.stat().st_mtime, path))
    if not readable:
        return Found(None, 0, skipped)
    latest_run = max(readable, key=lambda entry: entry[2])[0]
    _, step, _, path = max((entry for entry in readable if entry[0] == latest_run), key=lambda entry: entry[1:3])
    return Found(path, step, skipped)


def unreadable_reason(error: BaseException) -> str:
    """Why a checkpoint could not be read, in words (torch's zip reader names no cause)."""
    text = " ".join(str(error).split()) or type(error).__name__
    if "PytorchStreamReader" in text or "zip archive" in text or "mmap can only be used" in text:
        return "truncated or not a checkpoint (no complete zip archive)"
    refused = re.search(r"Unsupported global: GLOBAL (\S+)", text)
    if refused:  # a complete file: torch's message is a page long, with terminal colours
        return (
            f"it holds a Python object that torch.load(weights_only=True) refuses ({refused.group(1)}), as Lightning's "
            "resume does; if you trust the file, allow it with torch.serialization.add_safe_globals"
        )
    return text[:200]


def _sync_folder(folder: Path) -> None:
    """Flush the folder's entry for the renamed file, so that a power cut after the rename keeps it."""
    try:
        descriptor = os.open(folder, os.O_RDONLY)
    except OSError:  # a platform without folder descriptors: the rename itself is still atomic
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)
