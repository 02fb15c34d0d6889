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

import contextlib
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
import weakref
from dataclasses import dataclass

import torch

__all__ = ["PlannerProcess"]

_COMMAND = "lit_memtrain.planner.command"
_PREPARED = ("lit_memtrain.planner.fit_config", "lit_memtrain.planner.plan", "lit_memtrain.planner.report")
_CANNOT_SIMULATE_HERE = 3  # the forked child's exit status when the stand-in device cannot be registered in it
_POLL_S = 0.02


@dataclass
class _Children:
    """What :meth:`PlannerProcess.stop` ends: the forked child (its pid, the pipe its arguments go through and the
    folder of its output) and the new interpreter, whichever were started."""

    forked: int | None = None
    arguments: int | None = None
    output: str | None = None
    fresh: subprocess.Popen | None = None


class PlannerProcess:
    """A planner child, importing from the moment this is made; :meth:`run` plans once, :meth:`stop` (or the object
    being collected, or the interpreter exiting) ends it.

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
        """Plan with ``lit-memtrain plan``'s ``arguments``: its exit status and what it printed.

        Raises:
            subprocess.TimeoutExpired: it took more than ``timeout`` seconds (the child is killed).
        """
        children, line = self._children, json.dumps(arguments) + "\n"
        try:
            if children.forked is not None:
                result = self._run_forked(line, timeout)
                if result.returncode != _CANNOT_SIMULATE_HERE:
                    return result
                children.fresh = _fresh_interpreter()
            stdout, stderr = children.fresh.communicate(line, timeout=timeout)
            return subprocess.CompletedProcess(children.fresh.args, children.fresh.returncode, stdout, stderr)
        finally:
            self.stop()

    def _fork(self) -> None:
        output = tempfile.mkdtemp(prefix="lit-memtrain-plan-")
        read_end, write_end = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
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
        try:
            os.write(children.arguments, line.encode())
        except BrokenPipeError:  # it ended already (it could not register its device): its status says why
            pass
        os.close(children.arguments)
        children.arguments = None
        status = _wait(children.forked, timeout)
        children.forked = None
        stdout, stderr = (open(os.path.join(children.output, name)).read() for name in ("stdout", "stderr"))
        return subprocess.CompletedProcess([sys.executable, "-m", _COMMAND], status, stdout, stderr)


def _fork_is_safe() -> bool:
    """No Python thread but this one (a lock another thread holds at the fork stays held in the child) and no CUDA
    context (the child must not inherit one in use). Native thread pools are left: OpenBLAS's (started by importing
    numpy) handles a fork itself, and the child runs torch's operators on one thread, so OpenMP's pool is not used."""
    return sys.platform == "linux" and threading.active_count() == 1 and not torch.cuda.is_initialized()


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


def _wait(pid: int, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise subprocess.TimeoutExpired([sys.executable, "-m", _COMMAND], timeout)
        time.sleep(_POLL_S)


def _end(children: _Children) -> None:
    if children.arguments is not None:
        os.close(children.arguments)
        children.arguments = None
    if children.forked is not None:
        with contextlib.suppress(ProcessLookupError, ChildProcessError):  # reaped already (killed on a timeout)
            os.kill(children.forked, signal.SIGKILL)
            os.waitpid(children.forked, 0)
        children.forked = None
    if children.output is not None:
        shutil.rmtree(children.output, ignore_errors=True)
        children.output = None
    if children.fresh is not None:
        if children.fresh.poll() is None:
            children.fresh.kill()
            children.fresh.wait()
        for stream in (children.fresh.stdin, children.fresh.stdout, children.fresh.stderr):
            stream.close()
        children.fresh = None
