"""Writing a folder so that its name never shows a partial one: written beside it, renamed into place when complete.

Why: ``save_pretrained`` writes ``config.json`` first and the weights after it, so a full disk or a kill during an
export left a folder that looks like a model (``config.json`` there) without its weights. The folder is written
under a temporary name in the same parent and renamed when complete; a previous folder of that name is replaced only
then. A failed write removes its temporary; one a kill left (``.<name>.partial-<pid>``) is removed by the next write
of that folder.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

__all__ = ["PARTIAL_MARK", "replace_folder", "write_folder"]

PARTIAL_MARK = ".partial-"  # a folder written beside ``<name>`` is ``.<name>.partial-<pid>``


def write_folder(directory: str | Path, write: Callable[[Path], object]) -> Path:
    """Call ``write(folder)`` on a temporary folder beside ``directory`` and rename it to ``directory``.

    Raises:
        OSError: the write failed (``directory`` keeps what it held before, if anything).
    """
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    for orphan in directory.parent.glob(f".{directory.name}{PARTIAL_MARK}*"):
        shutil.rmtree(orphan, ignore_errors=True)
    partial = directory.with_name(f".{directory.name}{PARTIAL_MARK}{os.getpid()}")
    try:
        write(partial)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return replace_folder(partial, directory)


def replace_folder(partial: str | Path, directory: str | Path) -> Path:
    """Put the complete folder ``partial`` in the place of ``directory`` (what was there is removed after).

    A kill between the two renames leaves no ``directory``, and the previous one under a partial name: never a
    folder that looks complete and is not.
    """
    partial, directory = Path(partial), Path(directory)
    if directory.exists():
        previous = directory.with_name(f".{directory.name}{PARTIAL_MARK}{os.getpid()}-previous")
        os.replace(directory, previous)
        os.replace(partial, directory)
        shutil.rmtree(previous, ignore_errors=True)
    else:
        os.replace(partial, directory)
    return directory
