"""What a part of the GPU check writes: one JSON file that ``check.py`` collects into report.json and report.md.

A part is a script in this folder that takes ``--json PATH`` (write the results there) and ``--dry-run``
(tiny shapes on the CPU: the same code paths where they exist there, so the script cannot rot between GPU
runs; its figures mean nothing). It exits non-zero when one of its checks fails, after writing the JSON.
Scripts import this module as ``results`` (their own folder is first on ``sys.path``).

The JSON object::

    {"summary": "one line",
     "tables": [{"title": "...", "columns": ["setting", "peak GiB", "peak ratio"], "rows": [["a", 1.5, 1.0]]}],
     "checks": [{"name": "gradients equal with offloading", "passed": true, "detail": "max rel diff 1e-4"}],
     "config": {"seq_len": 32768}}

Figures go in the tables as measured; ratios against a baseline measured side by side in the same run
get their own columns. ``float('nan')`` (not measured, e.g. GPU memory in a dry run) is written as null.

Each setting of a part is measured by :func:`run_isolated`, in a fresh process of its own: a setting measured
after another in the same process measures what the earlier one left behind too (a module kept alive by a
callback, gradients kept for a comparison, decoder layers waiting for the garbage collector), which the first
GPU run did. The child proves its clean start (no CUDA memory allocated before the setting runs) and that the
objects the setting registered with :func:`watch` (its model, its module) are gone when it returns, without
the garbage collector: a setting that leaks fails, in a dry run on the CPU too.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import json
import math
import multiprocessing
import multiprocessing.util  # before the exit handler below, which must run before its own (LIFO)
import os
import pickle
import re
import sys
import traceback
import weakref
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "OPTIONAL_PACKAGES", "START_METHOD_VARIABLE", "SettingLeaked", "add_arguments", "check",
    "missing_optional_package", "run_isolated", "table", "watch", "write",
]

# Packages a bare GPU machine may lack (import names): what fails only for want of one of them is skipped.
OPTIONAL_PACKAGES = (
    "datasets", "wandb", "jsonargparse", "flash_attn", "bitsandbytes", "llvmlite", "pyarrow", "trl", "matplotlib",
    "vllm",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--json`` and ``--dry-run``, the two options ``check.py`` passes to every part."""
    parser.add_argument("--json", type=Path, default=None, help="also write the results to this JSON file")
    parser.add_argument(
        "--dry-run", action="store_true", help="tiny shapes on the CPU: checks that the script runs, measures nothing"
    )


def table(title: str, columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> dict[str, Any]:
    rows = [list(row) for row in rows]
    if any(len(row) != len(columns) for row in rows):
        raise ValueError(f"Table {title!r}: every row needs {len(columns)} values ({', '.join(columns)}).")
    return {"title": title, "columns": list(columns), "rows": rows}


def check(name: str, passed: bool, detail: str) -> dict[str, Any]:
    return {"name": name, "passed": bool(passed), "detail": detail}


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else str(value)
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


def write(
    path: Path | None,
    *,
    summary: str,
    tables: Sequence[dict[str, Any]],
    checks: Sequence[dict[str, Any]] = (),
    config: dict[str, Any] | None = None,
) -> bool:
    """Write the part's results to ``path`` (nothing when ``None``) and return whether every check passed."""
    result = {"summary": summary, "tables": list(tables), "checks": list(checks), "config": config or {}}
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(_finite(result), indent=1, allow_nan=False) + "\n")
    return all(item["passed"] for item in checks)


def missing_optional_package(output: str) -> str | None:
    """The package of :data:`OPTIONAL_PACKAGES` whose import failed in ``output`` (a traceback), if any."""
    for name in re.findall(r"No module named '([\w.]+)'", output):
        if name.split(".")[0] in OPTIONAL_PACKAGES:
            return name.split(".")[0]
    return None


class SettingLeaked(RuntimeError):
    """Objects a setting registered with :func:`watch` were still alive when it returned."""


class RemoteTraceback(Exception):
    """The traceback of an exception raised in the child of :func:`run_isolated` (its ``__cause__``)."""

    def __str__(self) -> str:
        return str(self.args[0])


# What the running setting registered with watch(): (description, weak reference, freed only by a garbage
# collection). Used in the child only.
_watched: list[tuple[str, weakref.ref, bool]] = []


def watch(obj: Any, name: str | None = None, *, after_collection: bool = False) -> None:
    """Register ``obj`` (a model, a LightningModule) as belonging to the setting that :func:`run_isolated` runs
    in this process: when the setting returns, ``obj`` must be gone, freed by reference counting alone (no
    garbage collection). Otherwise :class:`SettingLeaked` is raised, naming what still refers to it.

    ``after_collection=True`` for what a library holds in reference cycles that are not ours to break (a
    LightningModule after ``Trainer.fit``: the trainer's connectors refer to the trainer): then ``obj`` must be
    gone after ``gc.collect()``, so what a setting keeps (a callback kept after the run, which refers to its
    module through ``callback.log``) is still caught."""
    _watched.append((name or type(obj).__name__, weakref.ref(obj), after_collection))


def _cuda_allocated() -> int | None:
    """Bytes the caching allocator has handed out in this process; ``None`` without CUDA (torch imported only if
    the setting's module already did)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return None
    return torch.cuda.memory_allocated()


def _alive_watched() -> list[str]:
    """The registered objects still alive, each with the types of what refers to it: first those reference
    counting must have freed, then, after a garbage collection, the others."""
    alive = _alive([(name, reference) for name, reference, after_collection in _watched if not after_collection])
    collected = [(name, reference) for name, reference, after_collection in _watched if after_collection]
    if collected:
        gc.collect()
    return alive + [f"{item}, after a garbage collection" for item in _alive(collected)]


def _alive(watched: list[tuple[str, weakref.ref]]) -> list[str]:
    alive, here = [], sys._getframe()
    for name, reference in watched:
        obj = reference()
        if obj is not None:
            referrers = sorted({type(referrer).__name__ for referrer in gc.get_referrers(obj) if referrer is not here})
            alive.append(f"{name} (referred to by: {', '.join(referrers) or 'nothing the collector tracks'})")
            del obj
    return alive


def _run(function: Callable, args: tuple, kwargs: dict) -> bytes:
    """Check the clean start, run the setting, check the release: the outcome, pickled."""
    try:
        allocated = _cuda_allocated()
        if allocated:
            raise AssertionError(f"{allocated:,} bytes of CUDA memory were allocated before the setting ran in a fresh "
                                 "process: the measurement would not start clean")
        _watched.clear()
        result = function(*args, **kwargs)
        alive = _alive_watched()
        if alive:
            raise SettingLeaked(
                f"{function.__qualname__} returned but objects it registered with watch() are still alive: "
                f"{'; '.join(alive)}. A setting measured after this one in the same process "
                "would measure them too: drop every reference (callbacks kept after the run, reference cycles such "
                "as a wrapped forward stored on its module)."
            )
        return pickle.dumps(("result", result), protocol=pickle.HIGHEST_PROTOCOL)
    except BaseException as error:  # noqa: BLE001 - every failure goes to the parent, SystemExit included
        text = "".join(traceback.format_exception(error))
        try:
            return pickle.dumps(("error", error, text), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:  # an exception that does not pickle: its text
            return pickle.dumps(("error", None, text), protocol=pickle.HIGHEST_PROTOCOL)


def _serve(connection) -> None:
    """A child of :func:`run_isolated`: wait for one setting (none if the parent closes the pipe), run it, exit."""
    try:
        job = connection.recv_bytes()
    except EOFError:
        return
    function, args, kwargs = pickle.loads(job)
    connection.send_bytes(_run(function, args, kwargs))
    connection.close()


# Where CUDA is, a setting's process is spawned (a forked child cannot use CUDA), and the next one is started
# while a setting runs, so that its imports (10-20 s of torch, transformers and Lightning on a GPU machine) are
# paid while the GPU is busy. Without CUDA (a dry run) it is forked: spawning would import them again for every
# setting (minutes on a 2-core machine). Either way the setting goes to the child pickled, so what spawn cannot
# run fails in a dry run too. This variable overrides the choice ("spawn" or "fork"), for tests.
START_METHOD_VARIABLE = "GPU_CHECK_START_METHOD"
_spare: tuple[Any, Any, str] | None = None  # (process, connection, start method) of a child waiting for a setting


def _start_method() -> str:
    chosen = os.environ.get(START_METHOD_VARIABLE)
    if chosen:
        return chosen
    torch = sys.modules.get("torch")
    return "fork" if torch is not None and not torch.cuda.is_available() else "spawn"


def _start_child(method: str) -> tuple[Any, Any, str]:
    context = multiprocessing.get_context(method)
    connection, child_end = context.Pipe()
    process = context.Process(target=_serve, args=(child_end,), name="isolated setting")
    process.start()
    child_end.close()
    return process, connection, method


def _stop(process, connection) -> None:
    connection.close()
    if process.is_alive():
        process.kill()
    process.join()


@atexit.register
def _stop_spare() -> None:
    """The child started for a setting that never came is killed, not waited for (still importing, maybe): it
    runs before multiprocessing's exit handler, which would wait for it."""
    global _spare
    if _spare is not None:
        _stop(*_spare[:2])
        _spare = None


def run_isolated(function: Callable, /, *args: Any, timeout_s: float | None = None, **kwargs: Any) -> Any:
    """``function(*args, **kwargs)`` in a fresh process; its return value, or its exception re-raised here.

    Why: what a setting measures must be its own memory, not what earlier settings left in the process. The child
    (``multiprocessing.get_context("spawn")``; forked without CUDA, see :data:`START_METHOD_VARIABLE`) starts
    with nothing on the GPU (checked: ``torch.cuda.memory_allocated()`` is 0 before ``function`` runs) and ends
    with everything the setting registered with :func:`watch` freed (checked, see :class:`SettingLeaked`).

    ``function`` must be defined at module level in an importable module or in the script being run (it is
    pickled by reference and its module imported in the child, its top level run again, not its ``if __name__
    == "__main__"`` block); ``args``, ``kwargs`` and the return value must pickle (tensors do: move them to the
    CPU first, or they come back on the GPU). The child's exception is raised again here with the child's
    traceback as its ``__cause__``; an exception that does not pickle becomes a :class:`RuntimeError` with that
    traceback. At ``timeout_s`` seconds (counted from when the setting is handed over) the child is killed and
    :class:`TimeoutError` raised.

    Example::

        def measure_setting(seq_len: int, offload: bool) -> dict:  # at module level
            model = build_model()
            watch(model)
            ...
            return {"peak": torch.cuda.max_memory_allocated()}

        figures = {offload: run_isolated(measure_setting, 32768, offload, timeout_s=60) for offload in (False, True)}
    """
    global _spare
    method = _start_method()
    if _spare is not None and _spare[2] == method and _spare[0].is_alive():
        process, connection, _ = _spare
        _spare = None
    else:
        _stop_spare()
        process, connection, _ = _start_child(method)
    if method == "spawn":
        _spare = _start_child(method)
    name = getattr(function, "__qualname__", repr(function))
    outcome = None
    try:
        connection.send_bytes(pickle.dumps((function, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL))
        if not connection.poll(timeout_s):
            raise TimeoutError(f"{name} did not finish within {timeout_s} s in its own process, which was killed.")
        outcome = pickle.loads(connection.recv_bytes())
    except (EOFError, BrokenPipeError):
        process.join(timeout=10)
        raise RuntimeError(
            f"The process running {name} ended (exit code {process.exitcode}) without a result: killed (out of "
            "host memory?), crashed in native code, or its module failed to import (see its output above)."
        ) from None
    finally:
        if outcome is not None:
            process.join(timeout=60)  # the result is in: a child that does not exit (a stuck thread) is not waited for
        _stop(process, connection)
    if outcome[0] == "result":
        return outcome[1]
    _, error, text = outcome
    if error is None:
        raise RuntimeError(f"{name} failed in its own process:\n{text}")
    raise error from RemoteTraceback(f"\nIn the process running {name}:\n{text}")
