"""Checkpoint saves that cannot destroy the last good state: a kill, a rename across filesystems and a full disk
each leave the previous checkpoint under its name, and resume finds the newest readable one."""

from __future__ import annotations

import errno
import io
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from lit_memtrain.objectives import checkpoint_files
from lit_memtrain.objectives.atomic_checkpoint_io import AtomicCheckpointIO
from lit_memtrain.objectives.checkpoint_files import checkpoints_in, is_partial, newest_readable, remove_partials


def _checkpoint(step: int) -> dict:
    return {"global_step": step, "state_dict": {"weight": torch.full((64, 64), float(step))}}


def _saved_step(path: Path) -> int:
    return int(torch.load(path, weights_only=True)["global_step"])


_TORCH_SAVE = torch.save


def _half_written_save(checkpoint, file) -> None:
    """What a save looks like when it stops half way: half the bytes are in the file."""
    buffer = io.BytesIO()
    _TORCH_SAVE(checkpoint, buffer)
    file.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
    file.flush()


def test_a_save_killed_half_way_leaves_the_previous_checkpoint_and_an_orphan_the_next_start_removes(tmp_path):
    last = tmp_path / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint(_checkpoint(2), last)
    marker = tmp_path / "half-written"
    pid = os.fork()
    if pid == 0:  # the run being preempted: half of step 4's checkpoint written, then killed
        try:
            def stall(checkpoint, file):
                _half_written_save(checkpoint, file)
                marker.touch()
                time.sleep(60)

            torch.save = stall  # this process only: it is killed below
            AtomicCheckpointIO().save_checkpoint(_checkpoint(4), last)
        finally:
            os._exit(1)
    deadline = time.monotonic() + 30
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    assert _saved_step(last) == 2  # the final name holds the old file whole
    orphans = [path for path in tmp_path.iterdir() if is_partial(path)]
    assert len(orphans) == 1 and orphans[0].stat().st_size > 0
    assert checkpoints_in([tmp_path]) == [last]  # the orphan is never taken for a checkpoint
    assert remove_partials(tmp_path) == orphans and not orphans[0].exists()


def test_a_rename_that_would_cross_filesystems_never_copies_into_the_final_name(tmp_path, monkeypatch):
    last = tmp_path / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint(_checkpoint(2), last)

    def cross_device(source, destination):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(checkpoint_files.os, "replace", cross_device)
    with pytest.raises(OSError, match=r"Could not write .*last\.ckpt .*the file under that name, if any, is unchanged"):
        AtomicCheckpointIO().save_checkpoint(_checkpoint(4), last)
    monkeypatch.undo()
    assert _saved_step(last) == 2
    assert sorted(path.name for path in tmp_path.iterdir()) == ["last.ckpt"]


def test_a_full_disk_keeps_the_previous_checkpoint_and_says_so(tmp_path, monkeypatch):
    last = tmp_path / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint(_checkpoint(2), last)

    def disk_full(checkpoint, file):
        _half_written_save(checkpoint, file)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(OSError, match=r"Could not write .*last\.ckpt \(the disk is full\)") as raised:
        AtomicCheckpointIO().save_checkpoint(_checkpoint(4), last)
    monkeypatch.undo()
    assert raised.value.errno == errno.ENOSPC
    assert _saved_step(last) == 2
    assert sorted(path.name for path in tmp_path.iterdir()) == ["last.ckpt"]  # no partial file left


def test_resume_takes_the_highest_readable_step_and_names_what_it_skipped(tmp_path):
    io = AtomicCheckpointIO()
    io.save_checkpoint(_checkpoint(2), tmp_path / "last.ckpt")
    io.save_checkpoint(_checkpoint(4), tmp_path / "epoch=0-step=4.ckpt")
    (tmp_path / "epoch=0-step=6.ckpt").write_bytes((tmp_path / "last.ckpt").read_bytes()[:300])  # truncated
    (tmp_path / "empty.ckpt").touch()
    (tmp_path / "notes.ckpt").write_text("not a checkpoint")
    io.save_checkpoint({**_checkpoint(8), "user_state": Path("/run")}, tmp_path / "epoch=0-step=8.ckpt")  # complete
    os.utime(tmp_path / "last.ckpt")  # the newest file holds an older state
    found = newest_readable(checkpoints_in([tmp_path]))
    assert (found.path, found.step) == (tmp_path / "epoch=0-step=4.ckpt", 4)
    assert {path.name: reason for path, reason in found.skipped} == {
        "empty.ckpt": "an empty file",
        "epoch=0-step=6.ckpt": "truncated or not a checkpoint (no complete zip archive)",
        "epoch=0-step=8.ckpt": (
            f"it holds a Python object that torch.load(weights_only=True) refuses ({type(Path()).__module__}."
            f"{type(Path()).__name__}), as Lightning's resume does; if you trust the file, allow it with "
            "torch.serialization.add_safe_globals"
        ),
        "notes.ckpt": "truncated or not a checkpoint (no complete zip archive)",
    }


def test_resume_takes_the_run_that_saved_last_over_an_earlier_runs_higher_steps(tmp_path):
    io = AtomicCheckpointIO()
    for name, step, run in [("epoch=0-step=9.ckpt", 9, "earlier"), ("last-v1.ckpt", 3, "latest")]:
        io.save_checkpoint({**_checkpoint(step), "run": run}, tmp_path / name)
        os.utime(tmp_path / name, (step, {"earlier": 1000, "latest": 2000}[run]))
    found = newest_readable(checkpoints_in([tmp_path]), run_of=lambda checkpoint: checkpoint["run"])
    assert (found.path.name, found.step) == ("last-v1.ckpt", 3)
    assert newest_readable(checkpoints_in([tmp_path])).step == 9  # runs not told apart: the highest step


def test_a_distributed_checkpoint_counts_once_complete_and_its_interrupted_write_is_removed(tmp_path):
    complete = tmp_path / "epoch=0-step=4.ckpt"  # FSDP2Strategy's folder of shards, renamed into place when complete
    complete.mkdir()
    (complete / ".metadata").write_bytes(b"shards index")
    torch.save({"global_step": 4}, complete / "meta.pt")
    incomplete = tmp_path / "epoch=0-step=6.ckpt"  # shards without the index written last: not a checkpoint yet
    incomplete.mkdir()
    torch.save({"global_step": 6}, incomplete / "meta.pt")
    interrupted = tmp_path / f".epoch=0-step=8.ckpt.partial-{2**22 + 1}"
    interrupted.mkdir()
    (interrupted / "__0_0.distcp").write_bytes(b"half a shard")
    assert checkpoints_in([tmp_path]) == [complete, incomplete]
    found = newest_readable(checkpoints_in([tmp_path]))
    skipped = [(incomplete, "an incomplete distributed checkpoint (no .metadata)")]
    assert (found.path, found.step, found.skipped) == (complete, 4, skipped)
    assert remove_partials(tmp_path) == [interrupted] and not interrupted.exists()
