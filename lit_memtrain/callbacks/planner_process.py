"""The process that plans a fit for :class:`~lit_memtrain.callbacks.memory_plan_check.MemoryPlanCheck`, started
long before it is asked.

Why a process of its own: the simulation registers a stand-in accelerator, which must precede the process's first
backward and stays for the rest of the process (:mod:`lit_memtrain.planner.simulate`); a fit must not carry that.

Why started early, and forked where that is safe: a new Python interpreter spends about 5 s of CPU (on a 2-core
machine) importing torch, transformers and Lightning before it simulates anything, more than a small plan's
simulation takes. The process that makes the callback has imported them already, and when the callback is made
(a script building its ``Trainer``, LightningCLI instantiating the configuration) it has not started the fit: no
autograd has run, no CUDA context, no other Python thread. A child forked then starts with those imports done, imports the
planner while the fit prepares its data and loggers, registers its stand-in device, and waits for the fit's
description: the fit then waits for little more than the simulation. Where a fork is not safe (another Python
thread, or CUDA initialised already; not Linux) a new interpreter is started instead, as early, and imports in the
meantime. A forked child that finds it cannot register the stand-in device (autograd already ran in
the process it came from: a second fit in a notebook) exits at once, and a new interpreter plans instead.

Both read ``lit-memtrain plan``'s arguments as one JSON line (``python -m lit_memtrain.planner.command
--arguments-from-stdin``) and print what it prints. The planner is reached by its module name only: callbacks sit
below it (docs/architecture.md).
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch

__all__ = ["PlannerProcess"]

_COMMAND = "lit_memtrain.planner.command"
_PREPARED = ("lit_memtrain.planner.fit_config", "lit_memtrain.planner.plan", "lit_memtrain.planner.report")
_CANNOT_SIMULATE_HERE = 3  # the forked child's exit status when the stand-in device cannot be registered in it
_REFUSED = 2  # the planner's exit status for a configuration it cannot plan (the reason on stderr)
_POLL_S = 0.02
_READY = "ready"  # the file the forked child makes once it waits for its arguments
_READY_S = 30.0  # how long after being asked a forked child may take to get there (it needs well under a second)


@dataclass
class _Children:
    """What :meth:`PlannerProcess.stop` ends: the forked child (its pid, the pipe its arguments go through and the
    folder of its output) and the new interpreter, whichever were started, by the process that started them (a
    process forked from it later, a rank of a forking launcher, holds copies it must not touch)."""

    owner: int = field(default_factory=os.getpid)
    forked: int | None = None
    arguments: int | None = None
    output: str | None = None
    fresh: subprocess.Popen | None = None


class PlannerProcess:
    """A planner child, importing from the moment this is made; :meth:`run` plans, :meth:`stop` (or the object being
    collected, or the interpreter exiting) ends it.

    Example:
        >>> planner = PlannerProcess()  # doctest: +SKIP
        >>> result = planner.run(["--fit-config", "fit.json", "--json", "--gpu-memory", "80"], timeout=900)  # doctest: +SKIP
    """

    def __init__(self) -> None:
        self._children = _Children()
        self.stop = weakref.finalize(self, _end, self._children)
        if _fork_is_safe():
            self._fork()
        else:
            self._children.fresh = _fresh_interpreter()

    @property
    def forked(self) -> bool:
        """Whether the planner runs in a child forked from this process (else in a new interpreter)."""
        return self._children.forked is not None

    def run(self, arguments: list[str], timeout: float) -> subprocess.CompletedProcess:
        """Plan with ``lit-memtrain plan``'s ``arguments``: its exit status and what it printed. A forked child that
        fails (other than by refusing the configuration, status 2) is not trusted: a new interpreter plans again.
        Called in another process than the one that made this (a forked rank), or a second time, a new interpreter
        plans.

        Raises:
            subprocess.TimeoutExpired: it took more than ``timeout`` seconds (the child is killed).
        """
        children, line = self._children, json.dumps(arguments) + "\n"
        try:
            if os.getpid() != children.owner:
                self.stop()  # lets go of the copies, ends nothing
                children = self._children = _Children()
                self.stop = weakref.finalize(self, _end, children)
            if children.forked is not None:
                result = self._run_forked(line, timeout)
                if result.returncode in (0, _REFUSED):
                    return result
            fresh = children.fresh = children.fresh or _fresh_interpreter()
            stdout, stderr = fresh.communicate(line, timeout=timeout)
            return subprocess.CompletedProcess(fresh.args, fresh.returncode, stdout, stderr)
        finally:
            self.stop()

    def _fork(self) -> None:
        output = tempfile.mkdtemp(prefix="lit-memtrain-plan-")
        for name in ("stdout", "stderr"):  # there to read even if the child dies before writing them
            Path(output, name).touch()
        read_end, write_end = os.pipe()
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
        with warnings.catch_warnings():
            # Python 3.12+ warns of any other OS thread; numpy's OpenBLAS pool is one, and handles a fork itself.
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:  # the child: it never returns from here
            status = 1
            try:
                os.close(write_end)
                status = _plan_when_asked(read_end, output)
            except BaseException:  # noqa: BLE001  (reported in its stderr, the exit status says it failed)
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(status)
        os.close(read_end)
        self._children.forked, self._children.arguments, self._children.output = pid, write_end, output

    def _run_forked(self, line: str, timeout: float) -> subprocess.CompletedProcess:
        children = self._children
        descriptor, children.arguments = children.arguments, None
        try:
            os.write(descriptor, line.encode())
        except BrokenPipeError:  # it ended already (it could not register its device): its status says why
            pass
        finally:
            os.close(descriptor)
        pid, children.forked = children.forked, None
        status = _wait(pid, timeout, Path(children.output, _READY))
        stdout, stderr = (Path(children.output, name).read_text() for name in ("stdout", "stderr"))
        return subprocess.CompletedProcess([sys.executable, "-m", _COMMAND], status, stdout, stderr)


def _fork_is_safe() -> bool:
    """Linux, no Python thread but this one (a lock another thread holds at the fork stays held in the child), no
    CUDA context (the child must not inherit one in use), and no PrivateUse1 device registered yet (the planner
    registers its stand-in device as that, and autograd cannot use it in a child forked after its registration).
    Native thread pools are left: OpenBLAS's (started by importing numpy) handles a fork itself, and the child runs
    torch's operators on one thread, so OpenMP's pool is not used."""
    return (
        sys.platform == "linux"
        and threading.active_count() == 1
        and not torch.cuda.is_initialized()
        and torch._C._get_privateuse1_backend_name() == "privateuseone"
    )


def _plan_when_asked(arguments: int, output: str) -> int:
    """In the forked child: output to files, the stand-in device and the planner's imports, then one plan."""
    for descriptor, name in ((1, "stdout"), (2, "stderr")):
        file = os.open(os.path.join(output, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(file, descriptor)
        os.close(file)
    # New streams on the same descriptors: the parent's, copied by the fork, may hold its unwritten output.
    sys.stdout, sys.stderr = open(1, "w", closefd=False), open(2, "w", closefd=False)
    sys.stdin = open(os.devnull)
    torch.set_num_threads(1)  # a fake-tensor simulation computes nothing worth more threads
    try:
        importlib.import_module("lit_memtrain.planner.simulate").stand_in_device()
    except RuntimeError as error:
        print(error, file=sys.stderr)
        return _CANNOT_SIMULATE_HERE
    command = importlib.import_module(_COMMAND)
    for name in _PREPARED:
        importlib.import_module(name)
    Path(output, _READY).touch()
    with os.fdopen(arguments) as pipe:
        line = pipe.readline()
    return command.main(json.loads(line)) if line.strip() else 0


def _fresh_interpreter() -> subprocess.Popen:
    # The child imports the fit's classes (a module or callback of the user's own) as this process does.
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.Popen(
        [sys.executable, "-m", _COMMAND, "--arguments-from-stdin"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment,
    )  # fmt: skip


def _wait(pid: int, timeout: float, ready: Path) -> int:
    """The forked child's exit status, once it exits; killed after ``timeout`` seconds (``TimeoutExpired``), or
    after :data:`_READY_S` if it has not got as far as waiting for its arguments by then (stuck on something its
    fork copied: its status then says it failed, and a new interpreter plans instead)."""
    start = time.monotonic()
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        waited = time.monotonic() - start
        if waited > timeout or (waited > _READY_S and not ready.exists()):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            if waited > timeout:
                raise subprocess.TimeoutExpired([sys.executable, "-m", _COMMAND], timeout)
            return -signal.SIGKILL
        time.sleep(_POLL_S)


def _end(children: _Children) -> None:
    """Kill and reap what ``children`` started and remove its folder; in another process (a copy made by a fork),
    only close the copies of the pipes."""
    owner = os.getpid() == children.owner
    if children.arguments is not None:
        descriptor, children.arguments = children.arguments, None
        os.close(descriptor)
    if children.forked is not None:
        pid, children.forked = children.forked, None
        if owner:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    if children.output is not None:
        output, children.output = children.output, None
        if owner:
            shutil.rmtree(output, ignore_errors=True)
    if children.fresh is not None:
        fresh, children.fresh = children.fresh, None
        if owner and fresh.poll() is None:
            fresh.kill()
            fresh.wait()
        for stream in (fresh.stdin, fresh.stdout, fresh.stderr):
            stream.close()
