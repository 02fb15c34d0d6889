"""A ``CheckpointIO`` whose saves cannot destroy the last good checkpoint, on any local filesystem.

Why not Lightning's ``TorchCheckpointIO``: it writes the checkpoint to a temporary in ``$TMPDIR`` and moves it into
place; with the output on another filesystem the move copies into the final name, and a kill or a full disk during
the copy leaves a partial file there, after the previous good one was overwritten. This one writes beside the
destination and renames (:func:`~lit_memtrain.objectives.checkpoint_files.write_beside`). Remote paths (``s3://``)
keep Lightning's write: an object store puts a whole object or none.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.plugins.io import TorchCheckpointIO

from lit_memtrain.objectives.checkpoint_files import write_beside

__all__ = ["AtomicCheckpointIO"]


class AtomicCheckpointIO(TorchCheckpointIO):
    """Saves each checkpoint to a temporary in its own folder and renames it into place when complete.

    ``lit-memtrain fit`` uses it for every strategy whose checkpoint IO is Lightning's default. In Python::

        trainer = Trainer(plugins=[AtomicCheckpointIO()], callbacks=[ModelCheckpoint(save_last=True)])
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None or not isinstance(get_filesystem(path), LocalFileSystem):
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        os.makedirs(os.path.dirname(os.fspath(path)) or ".", exist_ok=True)
        write_beside(path, lambda file: torch.save(checkpoint, file))
