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
import gc
import json
import math
import multiprocessing
import pickle
import re
import sys
import traceback
import weakref
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "OPTIONAL_PACKAGES", "SettingLeaked", "add_arguments", "check", "missing_optional_package", "run_isolated",
    "table", "watch", "write",
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


# What the running setting registered with watch(): (description, weak reference). Used in the child only.
_watched: list[tuple[str, weakref.ref]] = []


def watch(obj: Any, name: str | None = None) -> None:
    """Register ``obj`` (a model, a LightningModule) as belonging to the setting that :func:`run_isolated` runs
    in this process: when the setting returns, ``obj`` must be gone, freed by reference counting alone (no
    garbage collection). Otherwise :class:`SettingLeaked` is raised, naming what still refers to it."""
    _watched.append((name or type(obj).__name__, weakref.ref(obj)))


def _cuda_allocated() -> int | None:
    """Bytes the caching allocator has handed out in this process; ``None`` without CUDA (torch imported only if
    the setting's module already did)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return None
    return torch.cuda.memory_allocated()


def _alive_watched() -> list[str]:
    """The registered objects still alive, each with the types of what refers to it."""
    alive, here = [], sys._getframe()
    for name, reference in _watched:
        obj = reference()
        if obj is not None:
            referrers = sorted({type(referrer).__name__ for referrer in gc.get_referrers(obj) if referrer is not here})
            alive.append(f"{name} (referred to by: {', '.join(referrers) or 'nothing the collector tracks'})")
            del obj
    return alive


def _run_in_child(connection, function: Callable, args: tuple, kwargs: dict) -> None:
    """The child of :func:`run_isolated`: check the clean start, run, check the release, send the outcome."""
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
                f"{function.__qualname__} returned but objects it registered with watch() are still alive without "
                f"garbage collection: {'; '.join(alive)}. A setting measured after this one in the same process "
                "would measure them too: drop every reference (callbacks kept after the run, reference cycles such "
                "as a wrapped forward stored on its module)."
            )
        payload = pickle.dumps(("result", result), protocol=pickle.HIGHEST_PROTOCOL)
    except BaseException as error:  # noqa: BLE001 - every failure goes to the parent, SystemExit included
        text = "".join(traceback.format_exception(error))
        try:
            payload = pickle.dumps(("error", error, text), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:  # an exception that does not pickle: its text
            payload = pickle.dumps(("error", None, text), protocol=pickle.HIGHEST_PROTOCOL)
    connection.send_bytes(payload)
    connection.close()


def run_isolated(function: Callable, /, *args: Any, timeout_s: float | None = None, **kwargs: Any) -> Any:
    """``function(*args, **kwargs)`` in a fresh ``spawn`` process; its return value, or its exception re-raised here.

    Why: what a setting measures must be its own memory, not what earlier settings left in the process. The child
    starts with nothing on the GPU (checked: ``torch.cuda.memory_allocated()`` is 0 before ``function`` runs) and
    ends with everything the setting registered with :func:`watch` freed (checked, see :class:`SettingLeaked`).

    ``function`` must be defined at module level in an importable module or in the script being run (``spawn``
    pickles it by reference and imports its module in the child, running its top level again, not its
    ``if __name__ == "__main__"`` block); ``args``, ``kwargs`` and the return value must pickle (tensors do: move
    them to the CPU first, or they come back on the GPU). The child's exception is raised again here with the
    child's traceback as its ``__cause__``; an exception that does not pickle becomes a :class:`RuntimeError`
    with that traceback. At ``timeout_s`` seconds the child is killed and :class:`TimeoutError` raised.

    Example::

        def measure_setting(seq_len: int, offload: bool) -> dict:  # at module level
            model = build_model()
            watch(model)
            ...
            return {"peak": torch.cuda.max_memory_allocated()}

        figures = {offload: run_isolated(measure_setting, 32768, offload, timeout_s=60) for offload in (False, True)}
    """
    context = multiprocessing.get_context("spawn")
    receiver, sender = context.Pipe(duplex=False)
    process = context.Process(
        target=_run_in_child, args=(sender, function, args, kwargs), name=f"isolated {function.__qualname__}"
    )
    process.start()
    sender.close()
    try:
        if not receiver.poll(timeout_s):
            process.kill()
            process.join()
            raise TimeoutError(
                f"{function.__qualname__} did not finish within {timeout_s} s in its own process, which was killed."
            )
        try:
            outcome = pickle.loads(receiver.recv_bytes())
        except EOFError:
            process.join()
            raise RuntimeError(
                f"The process running {function.__qualname__} ended (exit code {process.exitcode}) without a result: "
                "killed (out of host memory?) or crashed in native code."
            ) from None
    finally:
        receiver.close()
    process.join(timeout=60)  # the result is in: a child that does not exit (a stuck thread) is not waited for
    if process.is_alive():
        process.kill()
        process.join()
    if outcome[0] == "result":
        return outcome[1]
    _, error, text = outcome
    if error is None:
        raise RuntimeError(f"{function.__qualname__} failed in its own process:\n{text}")
    raise error from RemoteTraceback(f"\nIn the process running {function.__qualname__}:\n{text}")
