"""Run a test's worker on several CPU ranks (forked processes joined by gloo) and fail the test with each rank's error.

Why a helper: a distributed test forks its ranks, gives each the environment Lightning reads (``MASTER_ADDR``,
``MASTER_PORT``, ``WORLD_SIZE``, ``LOCAL_RANK``), waits for all of them with a deadline, kills the rest when one
hangs, and reports the traceback of the rank that failed rather than a bare exit code.

Example:
    >>> def worker(rank, out):
    ...     Trainer(devices=2, strategy=FSDP2Strategy(), accelerator="cpu").fit(...)
    >>> run_on_gloo_ranks(worker, (tmp_path,), world=2, errors=tmp_path, timeout_s=300)  # doctest: +SKIP
"""

from __future__ import annotations

import os
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from lightning.fabric.plugins.environments.lightning import find_free_network_port
from torch.distributed.tensor import DTensor


def _rank(rank: int, worker: Callable[..., Any], args: tuple, world: int, port: int, errors: Path) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world),
                       "NODE_RANK": "0", "LOCAL_RANK": str(rank)})
    torch.set_num_threads(1)
    try:
        worker(rank, *args)
    except Exception:  # noqa: BLE001 - reported by the test
        (errors / f"rank{rank}.error").write_text(traceback.format_exc())
        raise


def run_on_gloo_ranks(worker: Callable[..., Any], args: tuple, world: int, errors: Path, timeout_s: float) -> None:
    """Run ``worker(rank, *args)`` on ``world`` forked ranks; fail the test with the traceback of each rank that
    raised (written under ``errors``), or with a timeout after ``timeout_s`` seconds."""
    context = mp.start_processes(_rank, args=(worker, args, world, find_free_network_port(), errors), nprocs=world,
                                 join=False, start_method="fork")  # fmt: skip
    deadline = time.monotonic() + timeout_s
    try:
        while not context.join(timeout=max(1.0, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the {world} processes did not finish within {timeout_s} s")
    except Exception:
        for process in context.processes:
            if process.is_alive():
                process.kill()
        if not list(errors.glob("*.error")):
            raise
    for error in sorted(errors.glob("*.error")):
        pytest.fail(f"the distributed run failed on {error.stem}:\n{error.read_text()}")


def whole_on_host(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of ``tensor`` on the host, whole: a sharded parameter or gradient (DTensor) gathered from every rank."""
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().cpu().clone()
