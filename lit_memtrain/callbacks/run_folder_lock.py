"""Lightning callback that lets one fit at a time write into a checkpoint folder.

Why: two fits writing into one folder interleave their files (``last.ckpt`` from one run, ``last-v1.ckpt`` from the
other), and resuming one of them then restores the other's weights without a word. The first fit holds the folder;
a second one stops before its first step with one line naming the run that holds it.

How: an advisory lock (``flock``) on ``.lit-memtrain-run.lock`` in the folder, held open while the fit runs and
removed when it ends. The kernel drops the lock when the process ends, however it ends, so the hold of a killed run
is stale by construction and the next fit takes it over (saying so, from the run's details the file still holds).
Holding the folder also makes any temporary a killed save left there an orphan: they are removed
(:func:`~lit_memtrain.objectives.checkpoint_files.remove_partials`). Each fit also has an id, saved in its
checkpoints and kept when it is resumed, which tells an earlier run's checkpoints left in the folder from this
run's (:meth:`RunFolderLock.run_of`). Only global rank 0 locks; every rank stops together. A filesystem without
``flock`` (some network mounts) is reported and not locked; remote folders (``s3://``) are not locked.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import socket
import sys
import uuid
from pathlib import Path
from typing import IO, Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lit_memtrain.objectives.checkpoint_files import remove_partials

__all__ = ["RunFolderLock"]

LOCK_NAME = ".lit-memtrain-run.lock"


class RunFolderLock(Callback):
    """Hold every ``ModelCheckpoint`` folder of the fit, and refuse a fit whose folder a live run holds.

    ``lit-memtrain fit`` adds it. In Python::

        trainer = Trainer(callbacks=[ModelCheckpoint(dirpath="out/checkpoints", save_last=True), RunFolderLock()])

    Raises (at fit start):
        FileExistsError: a live run holds one of the folders; the message names it (process, host, start, command).
    """

    def __init__(self) -> None:
        self._held: list[IO[str]] = []
        self.run_id = uuid.uuid4().hex  # a resumed fit takes its checkpoint's (load_state_dict)

    def state_dict(self) -> dict[str, Any]:
        return {"run_id": self.run_id}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.run_id = state_dict.get("run_id", self.run_id)

    @classmethod
    def run_of(cls, checkpoint: dict[str, Any]) -> str | None:
        """The id of the fit that saved ``checkpoint`` (a fresh fit takes a new one, a resumed fit keeps it; None for
        a checkpoint saved without this callback): ``--ckpt_path last`` resumes the run that saved last."""
        return (checkpoint.get("callbacks") or {}).get(cls.__qualname__, {}).get("run_id")

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        refusal = None
        if trainer.is_global_zero:
            dirpaths = [str(getattr(cb, "dirpath", None) or "") for cb in trainer.checkpoint_callbacks]
            folders = {Path(dirpath) for dirpath in dirpaths if dirpath and "://" not in dirpath}  # local ones
            refusal = self._hold(sorted(folders))
        refusal = trainer.strategy.broadcast(refusal, src=0)
        if refusal:
            self.release()
            raise FileExistsError(refusal)

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.release()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self.release()

    @staticmethod
    def refusal(folder: str | Path) -> str | None:
        """What a fit is told when a live run holds ``folder`` (None when none does), without taking the folder:
        ``lit-memtrain fit`` asks before it starts anything (a W&B run, the data), the callback holds it later."""
        path = Path(folder) / LOCK_NAME
        if not path.is_file():
            return None
        with open(path) as file:
            try:
                fcntl.flock(file, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return _refusal(Path(folder), file.read())
            except OSError:  # no flock here: the callback warns
                return None
        return None

    def release(self) -> None:
        """Let the folders go: the lock file is removed while still held (a fit that opened it just before is
        refused, one that opens the name after makes a new one), then closed, which drops the flock."""
        for file in self._held:
            Path(file.name).unlink(missing_ok=True)
            file.close()
        self._held = []

    def _hold(self, folders: list[Path]) -> str | None:
        """Lock each folder; the refusal to raise when a live run holds one."""
        for folder in folders:
            folder.mkdir(parents=True, exist_ok=True)
            file = open(folder / LOCK_NAME, "a+")  # noqa: SIM115 -- held open for the whole fit
            try:
                fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                file.seek(0)
                holder = file.read()
                file.close()
                return _refusal(folder, holder)
            except OSError as error:
                file.close()
                rank_zero_warn(f"{folder} cannot be locked ({error.strerror}): nothing stops a second fit using it.")
                continue
            file.seek(0)
            stale = file.read()
            if stale.strip():
                ended = _describe(stale)
                rank_zero_info(f"{folder}: took over the hold of a run that ended without releasing it ({ended})")
            file.seek(0)
            file.truncate(0)
            file.write(json.dumps(_this_run()))
            file.flush()
            self._held.append(file)
            removed = remove_partials(folder)
            if removed:
                rank_zero_info(f"{folder}: removed {len(removed)} partial file(s) that interrupted saves left")
        return None


def _refusal(folder: Path, holder: str) -> str:
    return (
        f"{folder} is held by a run that is still going ({_describe(holder)}); two fits in one folder mix their "
        "checkpoints. Wait for it to end, or give this fit another folder (ModelCheckpoint's dirpath, or the "
        "logger's save_dir / --trainer.default_root_dir)."
    )


def _this_run() -> dict[str, Any]:
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
    }


def _describe(text: str) -> str:
    try:
        run = json.loads(text)
        return f"process {run['pid']} on {run['host']}, started {run['started']}: {run['command']}"
    except (ValueError, KeyError, TypeError):
        return "details unreadable"
