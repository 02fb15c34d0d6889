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

Each setting of a part is measured by :func:`run_isolated`, isolated from every other setting: a setting measured
after another in the same process measures what the earlier one left behind too (a module kept alive by a
callback, gradients kept for a comparison, decoder layers waiting for the garbage collector), which the first
GPU run did. So before a setting runs in the part's own process, it is proven clean: CUDA memory allocated back
at the floor the process had before its first setting (what CUDA libraries keep for the life of a process,
created up front), and every object the previous setting registered with :func:`watch` (its model, its module)
gone, without the garbage collector. Where that cannot be proven, the setting runs in a fresh process instead
(and a setting can ask for one). Either way the figures are the setting's own; a setting that leaks fails, in a
dry run on the CPU too. How each setting ran, and its time, goes into the JSON (``"settings"``).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import gc
import json
import math
import multiprocessing
import multiprocessing.util  # before the exit handler below, which must run before its own (LIFO)
import os
import pickle
import re
import signal
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "ISOLATION_VARIABLE", "OPTIONAL_PACKAGES", "START_METHOD_VARIABLE", "SettingLeaked", "add_arguments", "check",
    "missing_optional_package", "run_isolated", "table", "torch_flags", "watch", "write",
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
    """Write the part's results to ``path`` (nothing when ``None``) and return whether every check passed; with
    them, how each setting :func:`run_isolated` ran went (``"settings"``: where, why, seconds)."""
    result = {"summary": summary, "tables": list(tables), "checks": list(checks), "config": config or {},
              "settings": list(_ran)}
    if path is not None:  # whole or not at all: a part killed at its limit while writing leaves no half file
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".partial")
        partial.write_text(json.dumps(_finite(result), indent=1, allow_nan=False) + "\n")
        partial.replace(path)
    return all(item["passed"] for item in checks)


def missing_optional_package(output: str) -> str | None:
    """The package of :data:`OPTIONAL_PACKAGES` whose import failed in ``output`` (a traceback), if any."""
    for name in re.findall(r"No module named '([\w.]+)'", output):
        if name.split(".")[0] in OPTIONAL_PACKAGES:
            return name.split(".")[0]
    return None


class SettingLeaked(RuntimeError):
    """Objects a setting registered with :func:`watch` were still alive when it returned."""


# What the running setting registered with watch(): (description, weak reference, freed only by a garbage
# collection).
_watched: list[tuple[str, weakref.ref, bool]] = []

# How each setting of this process ran, in order: what write() puts under "settings".
_ran: list[dict[str, Any]] = []


def watch(obj: Any, name: str | None = None, *, after_collection: bool = False) -> None:
    """Register ``obj`` (a model, a LightningModule) as belonging to the setting that :func:`run_isolated` is
    running: when the setting returns, ``obj`` must be gone, freed by reference counting alone (no garbage
    collection). Otherwise :class:`SettingLeaked` is raised, naming what still refers to it.

    ``after_collection=True`` for what a library holds in reference cycles that are not ours to break (a
    LightningModule after ``Trainer.fit``: the trainer's connectors refer to the trainer): then ``obj`` must be
    gone after ``gc.collect()``, so what a setting keeps (a callback kept after the run, which refers to its
    module through ``callback.log``) is still caught."""
    _watched.append((name or type(obj).__name__, weakref.ref(obj), after_collection))


def _cuda_allocated() -> int | None:
    """Bytes the caching allocator has handed out in this process; ``None`` without CUDA (torch imported only if
    the setting's module already did). 0 while CUDA is not initialised (reading it initialises nothing)."""
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


def _check_released(name: str) -> None:
    alive = _alive_watched()
    if alive:
        raise SettingLeaked(
            f"{name} returned but objects it registered with watch() are still alive: {'; '.join(alive)}. A setting "
            "measured after this one in the same process would measure them too: drop every reference (callbacks "
            "kept after the run, reference cycles such as a wrapped forward stored on its module)."
        )


# --- A setting in this process, proven clean first --------------------------------------------------------------

# "process" runs every setting in a fresh process, as the second GPU run did (a process per setting cost 15-25 s
# there: the reason the default is this process, proven clean).
ISOLATION_VARIABLE = "GPU_CHECK_ISOLATION"
# CUDA bytes allocated in this process once the libraries' own memory exists and before its first setting; None
# until then.
_floor: int | None = None
# Why this process can no longer be proven clean for good: a setting raised in it (set by run_isolated), or changed
# torch's process-wide settings (set by _run_here).
_raised_here: str | None = None


def _library_floor() -> int:
    """Create what CUDA libraries keep for the life of a process, and return the bytes allocated then.

    Why: cuBLAS and cuBLASLt workspaces are taken from the caching allocator at a thread's first matrix product
    on a stream and kept, so ``memory_allocated`` after a first setting stays above 0 with nothing of the setting
    alive. Made here, before any setting (products forward and backward, on this thread and on autograd's device
    thread, in fp32 and bf16, with and without a bias), they become the floor every later setting must find again.
    Made again before each later comparison: Lightning frees them at the start and end of every fit on a GPU
    (``CUDAAccelerator.setup``/``teardown`` call ``torch._C._cuda_clearCublasWorkspaces``), which would leave
    ``memory_allocated`` below the floor after every Lightning setting. Made again, they need nothing new where
    they exist. A setting that makes more of them (a product on a stream of its own) leaves memory above the
    floor: the next setting then runs in a fresh process, which is slower, never wrong."""
    import torch

    for dtype in (torch.float32, torch.bfloat16):
        inputs, weight, bias = (torch.randn(*shape, device="cuda", dtype=dtype, requires_grad=True)
                                for shape in ((64, 64), (64, 64), (64,)))  # fmt: skip
        (torch.nn.functional.linear(inputs, weight, bias).sum() + (inputs @ weight.T).sum()).backward()
        del inputs, weight, bias
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def _release() -> None:
    """Give back what a finished setting may leave that is not an object of its own: reference cycles, the
    allocator's cached blocks and peak, a memory cap, the default process group (Lightning's strategies start one
    and never end it)."""
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is None:
        return
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        # Pinned host blocks a setting freed stay cached for the next one (offloading copies through them): given
        # back, so the host memory a setting measures is its own too. Public in torch 2.13; torch 2.11 (the GPU
        # image's) has no such call and keeps them.
        empty_host_cache = getattr(torch.accelerator, "empty_host_cache", None)
        if empty_host_cache is not None:
            empty_host_cache()


def _why_not_clean() -> str | None:
    """``None`` when this process is proven clean for the next setting, else why not (after releasing what
    :func:`_release` releases): an object of the previous setting alive, or CUDA memory off the floor."""
    global _floor
    _release()  # also after a raise: the settings that run elsewhere need the GPU memory this process cached
    if _raised_here is not None:
        return _raised_here
    alive = _alive([(name, reference) for name, reference, _ in _watched])
    if alive:
        return f"the previous setting's {'; '.join(alive)} still alive"
    allocated = _cuda_allocated()
    if allocated is None:  # no CUDA: the watched objects are the proof
        return None
    if _floor is None:
        if allocated:
            return f"{allocated:,} bytes of CUDA memory allocated in this process before its first setting"
        _floor = _library_floor()
        return None
    allocated = _library_floor()  # the workspaces a setting's library freed (Lightning's fits do) made again
    if allocated != _floor:
        return (f"{allocated:,} bytes of CUDA memory allocated where this process started its settings with "
                f"{_floor:,} (the libraries' own)")
    return None


@contextlib.contextmanager
def _time_limit(timeout_s: float | None, name: str) -> Iterator[None]:
    """Raise :class:`TimeoutError` in the setting at ``timeout_s`` (the main thread only: signals)."""
    if timeout_s is None or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum: int, frame: Any) -> None:
        raise TimeoutError(f"{name} did not finish within {timeout_s} s (stopped in the part's own process).")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _drop_frames(error: BaseException) -> None:
    """Free the locals of the frames an exception (and those chained to it) keeps: a caller that handles it and
    goes on would otherwise keep the setting's tensors, and the next setting would have to run elsewhere."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        error = error.__cause__ or error.__context__


def torch_flags() -> dict[str, Any]:
    """torch's process-wide settings that change what a later setting measures and that no proof of memory sees:
    TF32 and reduced-precision reductions, SDPA's kernels, cuDNN's choices, the default dtype, grad mode, threads.
    Empty while torch is not imported. Why: a library that turns one on in a setting (``TrainingArguments(tf32=...)``,
    an ``sdpa_kernel`` left entered) would time every later setting of the process under it, unseen."""
    torch = sys.modules.get("torch")
    if torch is None:
        return {}
    backends = torch.backends
    return {
        "default dtype": torch.get_default_dtype(), "grad mode": torch.is_grad_enabled(),
        "float32 matmul precision": torch.get_float32_matmul_precision(),
        "fp32 precision (matmul, cuDNN)": (getattr(backends.cuda.matmul, "fp32_precision", None),
                                           getattr(backends.cudnn, "fp32_precision", None)),
        "reduced-precision reductions (bf16, fp16)": (backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
                                                      backends.cuda.matmul.allow_fp16_reduced_precision_reduction),
        "SDPA kernels (flash, memory-efficient, math, cuDNN)": (
            backends.cuda.flash_sdp_enabled(), backends.cuda.mem_efficient_sdp_enabled(),
            backends.cuda.math_sdp_enabled(), backends.cuda.cudnn_sdp_enabled()),
        "cuDNN benchmark, deterministic": (backends.cudnn.benchmark, backends.cudnn.deterministic),
        "deterministic algorithms": torch.are_deterministic_algorithms_enabled(), "threads": torch.get_num_threads(),
    }  # fmt: skip


def _changed_flags(before: dict[str, Any]) -> str:
    """The :func:`torch_flags` that differ from ``before`` (``name: before -> now``), or ``""``."""
    now = torch_flags()
    return "; ".join(f"{key}: {value} -> {now[key]}" for key, value in before.items() if now.get(key) != value)


def _run_here(function: Callable, args: tuple, kwargs: dict, timeout_s: float | None) -> Any:
    """The setting in this process: arguments and result pickled as they would be to and from a fresh one, the
    environment variables it set taken back (Lightning leaves ``MASTER_PORT`` for the next run to reuse), and torch's
    process-wide settings compared (one it changed sends every later setting to a fresh process)."""
    global _raised_here
    name = getattr(function, "__qualname__", repr(function))
    function, args, kwargs = pickle.loads(pickle.dumps((function, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL))
    _watched.clear()
    environment = dict(os.environ)
    flags = torch_flags()
    try:
        with _time_limit(timeout_s, name):
            result = function(*args, **kwargs)
    except BaseException as error:
        _drop_frames(error)
        raise
    finally:
        os.environ.clear()
        os.environ.update(environment)
    changed = _changed_flags(flags)
    if changed:
        _raised_here = f"{name} changed torch's process-wide settings ({changed})"
    _check_released(name)
    return pickle.loads(pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL))


# --- A setting in a fresh process ------------------------------------------------------------------------------


class RemoteTraceback(Exception):
    """The traceback of an exception raised in the child of :func:`run_isolated` (its ``__cause__``)."""

    def __str__(self) -> str:
        return str(self.args[0])


def _run(function: Callable, args: tuple, kwargs: dict) -> bytes:
    """Check the clean start, run the setting, check the release: the outcome and the setting's seconds, pickled."""
    try:
        allocated = _cuda_allocated()
        if allocated:
            raise AssertionError(f"{allocated:,} bytes of CUDA memory were allocated before the setting ran in a fresh "
                                 "process: the measurement would not start clean")
        _watched.clear()
        start = time.perf_counter()
        result = function(*args, **kwargs)
        seconds = time.perf_counter() - start
        _check_released(function.__qualname__)
        return pickle.dumps(("result", result, seconds), protocol=pickle.HIGHEST_PROTOCOL)
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


# Where CUDA is, a fresh process is spawned (a forked child cannot use CUDA), and with GPU_CHECK_ISOLATION=process
# the next one is started while a setting runs, so that its imports are paid while the GPU is busy. Without CUDA
# (a dry run) it is forked: spawning would import torch, transformers and Lightning again for every setting
# (minutes on a 2-core machine). Either way the setting goes to the child pickled, so what spawn cannot run fails
# in a dry run too. This variable overrides the choice ("spawn" or "fork"), for tests.
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


def _run_in_child(
    function: Callable, args: tuple, kwargs: dict, timeout_s: float | None, spare: bool
) -> tuple[Any, float]:
    """The setting in a fresh process: its result and the seconds the setting itself took there."""
    global _spare
    method = _start_method()
    if _spare is not None and _spare[2] == method and _spare[0].is_alive():
        process, connection, _ = _spare
        _spare = None
    else:
        _stop_spare()
        process, connection, _ = _start_child(method)
    if spare and method == "spawn":
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
        return outcome[1], outcome[2]
    _, error, text = outcome
    if error is None:
        raise RuntimeError(f"{name} failed in its own process:\n{text}")
    raise error from RemoteTraceback(f"\nIn the process running {name}:\n{text}")


def run_isolated(
    function: Callable, /, *args: Any, timeout_s: float | None = None, fresh: bool = False, **kwargs: Any
) -> Any:
    """``function(*args, **kwargs)``, isolated from every other setting; its return value, or its exception.

    Why: what a setting measures must be its own memory, not what earlier settings left in the process, and a
    process per setting costs 15-25 s on a GPU machine (imports, CUDA start, first kernels), so it runs in this
    process when this process is proven clean (see :func:`_why_not_clean`: every object the previous setting
    registered with :func:`watch` gone, CUDA memory allocated back at the floor of the libraries' own), and in a
    fresh process otherwise, or when ``fresh=True`` (for what changes a process for good: the planner registers
    its stand-in device in the process it runs in), or for every setting with the environment variable
    ``GPU_CHECK_ISOLATION=process``, or once a setting raised in this process (an error, its time limit: stopped
    part way, it may have left what no proof sees). A setting run here also starts with the allocators' caches
    (device and pinned host) emptied, the peak reset, no memory cap and no process group. Either way the objects registered with :func:`watch` must be
    freed when ``function`` returns (see :class:`SettingLeaked`), and each setting is recorded (where it ran,
    why, its seconds) for :func:`write` and printed on stderr.

    ``function`` must be defined at module level in an importable module or in the script being run (it may be
    pickled by reference to a spawned child, which imports its module again, running its top level, not its ``if
    __name__ == "__main__"`` block); ``args``, ``kwargs`` and the return value must pickle, and are pickled in
    this process too (tensors do: move them to the CPU first, or they come back on the GPU and keep the memory
    off the floor). In a fresh process the child's exception is raised again here with the child's traceback as
    its ``__cause__``; an exception that does not pickle becomes a :class:`RuntimeError` with that traceback. At
    ``timeout_s`` seconds :class:`TimeoutError` is raised (in this process by ``SIGALRM``, which a native call
    that never returns defers: the part's own limit in check.py still stops it; a fresh process is killed).

    Example::

        def measure_setting(seq_len: int, offload: bool) -> dict:  # at module level
            model = build_model()
            watch(model)
            ...
            return {"peak": torch.cuda.max_memory_allocated()}

        figures = {offload: run_isolated(measure_setting, 32768, offload, timeout_s=60) for offload in (False, True)}
    """
    global _raised_here
    name = getattr(function, "__qualname__", repr(function))
    shown = ", ".join([repr(arg) for arg in args] + [f"{key}={value!r}" for key, value in kwargs.items()])
    shown = f"{name}({shown if len(shown) <= 80 else shown[:77] + '...'})"
    every_fresh = os.environ.get(ISOLATION_VARIABLE) == "process"
    reason = ("asked for" if fresh else f"{ISOLATION_VARIABLE}=process" if every_fresh else _why_not_clean())
    start = time.perf_counter()
    if reason is None:
        floor = _cuda_allocated()
        record = {"setting": name, "call": shown, "process": "this one",
                  "detail": "proven clean" + (f": {floor:,} bytes allocated, the floor" if floor is not None else "")}
        try:
            result = _run_here(function, args, kwargs, timeout_s)
        except SettingLeaked:
            raise  # it returned: what it left alive is what the next proof looks for
        except BaseException as error:
            # A setting stopped part way (an error, its time limit) may leave what no proof sees: a technique's
            # global patch never undone, a library's state half set. Every later setting runs elsewhere.
            _raised_here = f"{name} raised {type(error).__name__} in this process, which may have left it changed"
            raise
        finally:
            record["seconds"] = round(time.perf_counter() - start, 2)
            _ran.append(record)
            print(f"[setting] {shown}: {record['seconds']:.1f} s in this process ({record['detail']})",
                  file=sys.stderr, flush=True)
        return result
    _release()  # what this process cached would be GPU memory the fresh one lacks (asked for, or every setting fresh)
    record = {"setting": name, "call": shown, "process": "fresh", "detail": reason}
    try:
        result, seconds = _run_in_child(function, args, kwargs, timeout_s, spare=every_fresh)
        record["setting_s"] = round(seconds, 2)
    finally:
        record["seconds"] = round(time.perf_counter() - start, 2)
        _ran.append(record)
        print(f"[setting] {shown}: {record['seconds']:.1f} s in a fresh process ({reason})"
              + (f", {record['setting_s']:.1f} s of it the setting's own" if "setting_s" in record else ""),
              file=sys.stderr, flush=True)
    return result
