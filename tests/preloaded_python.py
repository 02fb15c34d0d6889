"""Python processes for tests: forked from a server that has imported torch, Lightning and lit_memtrain once,
and, for what the tests of a module will need, started early in the background.

Why forked: a test that needs a process of its own (the planner's stand-in device must be registered before
the process's first backward, which the pytest process has long run) paid 5-7 s of imports per ``python -c``,
more than most simulations take. The server imports the heavy modules once, runs no autograd and starts no
thread, and then forks: each child is the fresh process the script needs, with the imports already done, and
nothing it does (registering the stand-in device, patching a module, exiting) reaches the next script. A child
runs its script as ``python -c`` or ``python -m`` would: as ``__main__``, with ``sys.argv``, stdout and stderr
to files, stdin empty, in the server's environment (with the variables given) and working directory (or the
one given); an uncaught exception prints its traceback and exits with status 1. It exits without tearing the interpreter down
(``atexit`` handlers run, stdio is flushed), as a forked ``multiprocessing`` child does. A ``fresh`` run
replaces the forked child with a new interpreter: for a script that checks what an import pulls in, or one that
needs its environment at start-up.

Why early: most tests use one core of two, and a simulation is one single-threaded process. Runs queued with
:meth:`PreloadedPython.start` (tests/conftest.py queues a module's ``start_early`` when collection ends) run one
at a time on the other core while earlier tests run; :meth:`PreloadedPython.run` with the same arguments then
collects the result, or starts the run at once if it has not started yet. What a run computes does not depend
on when it runs.
"""

from __future__ import annotations

import atexit
import builtins
import contextlib
import gc
import importlib
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

__all__ = ["PreloadedPython"]

_POLL_S = 0.05  # how often the server looks for children that ended while some run


class PreloadedPython:
    """Client of the server (this file run as a script), started on the first request; ``close`` stops both.

    Arguments are what follows ``python`` on a command line: ``("-c", code, *argv)`` or ``("-m", module, *argv)``,
    or with ``fresh=True`` anything (a script's path and its arguments); ``env`` holds variables to set over the
    server's environment (the tests' when collection ended), ``cwd`` the working directory.
    """

    def __init__(self, modules: tuple[str, ...], directory: Path) -> None:
        self.modules = modules
        self.directory = directory
        self._server: subprocess.Popen | None = None
        self._log = directory / "server.log"  # the server's stderr: why it died, if it does
        self._pending = b""  # what the server wrote past the last line read
        self._runs = 0
        self._early: dict[str, list[int]] = {}  # the runs started early, not yet collected, by their request
        self._pids: dict[int, int] = {}
        self._returncodes: dict[int, int] = {}

    def start(self, *args: str, fresh: bool = False, env: dict[str, str] | None = None, cwd: str | None = None) -> None:
        """Queue ``python *args`` to run in the background, after the runs queued before it."""
        key, request = self._request(args, fresh, env, cwd)
        self._send(request | {"background": True})
        self._early.setdefault(key, []).append(request["id"])

    def run(
        self, *args: str, timeout: float = 600, fresh: bool = False, env: dict[str, str] | None = None,
        cwd: str | None = None,
    ) -> subprocess.CompletedProcess:  # fmt: skip
        """``subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout)``: the run
        started early with the same arguments if there is one (at once if it is still queued), else a new one."""
        key, request = self._request(args, fresh, env, cwd)
        if self._early.get(key):
            run = self._early[key].pop(0)
            if run not in self._pids:
                self._send({"promote": run})
        else:
            run = request["id"]
            self._send(request | {"background": False})
        returncode = self._wait(run, timeout)
        stdout, stderr = (self._output(run, name) for name in ("stdout", "stderr"))
        if returncode is None:
            raise subprocess.TimeoutExpired([sys.executable, *args], timeout, stdout, stderr)
        return subprocess.CompletedProcess([sys.executable, *args], returncode, stdout, stderr)

    def close(self) -> None:
        """Stop the server; it kills the runs still going (started early for tests that did not run)."""
        if self._server is not None:
            self._server.stdin.close()
            try:
                self._server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._server.kill()
                self._server.wait()
            self._server = None

    def _request(self, args: tuple[str, ...], fresh: bool, env: dict[str, str] | None, cwd: str | None):
        if not fresh and (len(args) < 2 or args[0] not in ("-c", "-m")):
            raise ValueError(f"Give ('-c', code, ...) or ('-m', module, ...), or fresh=True; got {args}.")
        key = json.dumps([args, fresh, env, cwd], sort_keys=True)
        self._runs += 1
        files = {name: str(self.directory / f"{self._runs}.{name}") for name in ("stdout", "stderr")}
        return key, {"id": self._runs, "args": list(args), "fresh": fresh, "env": env, "cwd": cwd} | files

    def _output(self, run: int, name: str) -> str:
        path = self.directory / f"{run}.{name}"
        return path.read_text() if path.exists() else ""

    def _send(self, message: dict) -> None:
        if self._server is None or self._server.poll() is not None:
            with self._log.open("a") as log:
                self._server = subprocess.Popen(
                    [sys.executable, __file__, *self.modules], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                    stderr=log, text=True, bufsize=1,
                )
            self._pending = b""
        self._server.stdin.write(json.dumps(message) + "\n")
        self._server.stdin.flush()

    def _wait(self, run: int, timeout: float) -> int | None:
        """Read the server's replies until ``run`` has ended; None (and the run killed) after ``timeout`` s,
        counted from when it started."""
        deadline, killed = None, False
        while run not in self._returncodes:
            if deadline is None and run in self._pids:
                deadline = time.monotonic() + timeout
            wait_s = None if deadline is None or killed else max(deadline - time.monotonic(), 0)
            if not self._read_reply(wait_s):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self._pids[run], signal.SIGKILL)
                killed = True
        return None if killed else self._returncodes[run]

    def _read_reply(self, wait_s: float | None) -> bool:
        """Read one reply of the server (the start or the end of a run); False if none came within ``wait_s``."""
        fd = self._server.stdout.fileno()
        while b"\n" not in self._pending:
            if wait_s is not None and not select.select([fd], [], [], wait_s)[0]:
                return False
            chunk = os.read(fd, 65536)
            if not chunk:
                raise RuntimeError(f"The preloaded Python died: {self._log.read_text()[-3000:]}")
            self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        reply = json.loads(line)
        if "pid" in reply:
            self._pids[reply["id"]] = reply["pid"]
        else:
            self._returncodes[reply["id"]] = reply["returncode"]
        return True


def _serve(modules: list[str]) -> dict:
    """Import ``modules``, then fork a child per request; return the request in the child.

    A request runs at once, or, queued as ``background``, when the background run before it has ended: one
    at a time, so that it takes the core the tests leave idle and not theirs. ``promote`` runs a queued one at once.
    """
    for name in modules:
        importlib.import_module(name)
    if threading.active_count() != 1:  # a thread's locks would be held forever in a forked child
        raise RuntimeError(f"Importing {modules} started threads: {threading.enumerate()}")
    gc.freeze()  # the collector leaves the imported objects alone: children do not copy their pages
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything else written to stdout goes to the log, not into the replies
    received, queued, running, background = b"", [], {}, None
    while True:
        if select.select([0], [], [], _POLL_S if running or queued else None)[0]:
            chunk = os.read(0, 65536)
            if not chunk:
                break
            received += chunk
            *lines, received = received.split(b"\n")
            for message in map(json.loads, lines):
                if "promote" in message:  # unless it has started meanwhile
                    promoted = [request for request in queued if request["id"] == message["promote"]]
                    if not promoted:
                        continue
                    message = promoted[0]
                    queued.remove(message)
                elif message["background"]:
                    queued.append(message)
                    continue
                pid = _fork(message, replies)
                if pid == 0:
                    return message
                running[pid] = message["id"]
        while running:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            replies.write(json.dumps({"id": running.pop(pid), "returncode": os.waitstatus_to_exitcode(status)}) + "\n")
            background = None if pid == background else background
        if background is None and queued:
            message = queued.pop(0)
            background = _fork(message, replies)
            if background == 0:
                return message
            running[background] = message["id"]
    for pid in running:  # the client has gone: what still runs was started early for tests that did not run
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    sys.exit(0)


def _fork(request: dict, replies) -> int:
    """Fork the child that runs ``request``; in the server, report its pid."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os.setpgid(0, 0)  # its own process group: a run killed at its timeout takes its children along
        replies.close()
        return 0
    replies.write(json.dumps({"id": request["id"], "pid": pid}) + "\n")
    return pid


def _become_script(request: dict) -> None:
    """In the child: stdio, ``sys.argv``, ``sys.path`` and ``__main__`` as ``python -c``/``-m`` sets them."""
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], os.O_WRONLY | os.O_CREAT),
                            (2, request["stderr"], os.O_WRONLY | os.O_CREAT)):  # fmt: skip
        opened = os.open(path, flags, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    if request["cwd"] is not None:
        os.chdir(request["cwd"])
    if request["env"] is not None:
        os.environ.update(request["env"])
    if request["fresh"]:
        os.execv(sys.executable, [sys.executable, *request["args"]])
    option, target, *argv = request["args"]
    sys.argv = [option, *argv]
    sys.path[0] = ""
    main = types.ModuleType("__main__")
    main.__builtins__ = builtins
    sys.modules["__main__"] = main
    if option == "-m":
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        exec(compile(target, "<string>", "exec"), main.__dict__)


def _exit_status(error: BaseException | None) -> int:
    """The status ``python`` exits with after this error, which it prints as it would."""
    if error is None:
        return 0
    if isinstance(error, SystemExit):
        if error.code is None or isinstance(error.code, int):
            return error.code or 0
        print(error.code, file=sys.stderr)
        return 1
    sys.excepthook(type(error), error, error.__traceback__)
    return 1


def _run_child(request: dict) -> None:
    """Run the script, then exit as ``python`` does but without tearing the interpreter down: tearing down
    touches every imported object, so the child would copy the server's memory page by page (seconds)."""
    error = None
    try:
        _become_script(request)
    except BaseException as raised:  # noqa: BLE001 - reported as python reports it
        error = raised
    status = _exit_status(error)
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    _run_child(_serve(sys.argv[1:]))
