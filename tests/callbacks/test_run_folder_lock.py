"""One fit at a time per checkpoint folder: a second holder is refused naming the first, a released folder is
free, a stale hold (its process gone) is taken over, and what killed saves left there is removed."""

from __future__ import annotations

import json
import logging
import os
from types import SimpleNamespace

import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

from lit_memtrain.callbacks.run_folder_lock import LOCK_NAME, RunFolderLock
from lit_memtrain.cli.library_noise import RANK_ZERO_LOGGER


def _trainer(folder):
    """What the callback reads of a one-process Trainer whose checkpoints go to ``folder``."""
    return SimpleNamespace(
        is_global_zero=True, checkpoint_callbacks=[ModelCheckpoint(dirpath=folder)],
        strategy=SimpleNamespace(broadcast=lambda value, src=0: value),
    )  # fmt: skip


def test_a_second_holder_is_refused_naming_the_first_until_it_releases(tmp_path):
    first, second = RunFolderLock(), RunFolderLock()
    first.on_fit_start(_trainer(tmp_path), None)
    expected = rf"^{tmp_path} is held by a run that is still going \(process {os.getpid()} on "
    with pytest.raises(FileExistsError, match=expected):
        second.on_fit_start(_trainer(tmp_path), None)
    assert RunFolderLock.refusal(tmp_path).startswith(f"{tmp_path} is held by a run that is still going")
    first.on_fit_end(None, None)
    assert RunFolderLock.refusal(tmp_path) is None and not (tmp_path / LOCK_NAME).exists()  # ended: nothing left
    second.on_fit_start(_trainer(tmp_path), None)
    second.on_exception(None, None, RuntimeError("a crash releases it too"))
    assert RunFolderLock.refusal(tmp_path) is None


def test_a_stale_hold_is_taken_over_and_the_partial_files_of_killed_saves_removed(tmp_path, caplog):
    killed = {"pid": 4242, "host": "node-7", "started": "2026-12-04T17:00:00+00:00", "command": "lit-memtrain fit"}
    (tmp_path / LOCK_NAME).write_text(json.dumps(killed))  # written by a run that was killed: no process holds it
    (tmp_path / ".last.ckpt.partial-4242").write_bytes(b"half")
    (tmp_path / "last.ckpt").write_bytes(b"kept")
    lock = RunFolderLock()
    with caplog.at_level(logging.INFO, logger=RANK_ZERO_LOGGER):
        lock.on_fit_start(_trainer(tmp_path), None)
    assert caplog.messages == [
        f"{tmp_path}: took over the hold of a run that ended without releasing it (process 4242 on node-7, started "
        "2026-12-04T17:00:00+00:00: lit-memtrain fit)",
        f"{tmp_path}: removed 1 partial file(s) that interrupted saves left",
    ]
    assert sorted(path.name for path in tmp_path.iterdir()) == [LOCK_NAME, "last.ckpt"]
    lock.release()
