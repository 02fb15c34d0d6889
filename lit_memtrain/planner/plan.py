"""A memory plan: one configuration's simulated step against a GPU, the longest length, the comparison.

Why a margin: the simulation counts the bytes PyTorch allocates (what ``torch.cuda.max_memory_allocated``
reports). A GPU also holds the CUDA context and kernel workspaces outside those, and the caching allocator
loses some memory to fragmentation (less with expandable segments, which ``lit-memtrain`` turns on). A plan
therefore fits when its peak is at most ``(1 - margin) x`` the GPU's memory; the default margin is 10%.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from lit_memtrain.planner.search import LengthSearch, find_max_length
from lit_memtrain.planner.settings import PlanSettings
from lit_memtrain.planner.simulate import stand_in_device, stand_in_device_registered
from lit_memtrain.planner.step import StepSimulation, simulate_fit_step
from lit_memtrain.planner.techniques import (
    Techniques,
    comparison_rows,
    suggestions,
    techniques_of,
    with_techniques,
)

__all__ = ["DEFAULT_GPU_MEMORY_GIB", "DEFAULT_MARGIN", "Budget", "ComparisonRow", "Planner", "gpu_budget"]

GIB = 2**30
DEFAULT_GPU_MEMORY_GIB = 80.0
DEFAULT_MARGIN = 0.10
_BREAKDOWN = ("parameters", "gradients", "optimizer_state", "activations", "temporaries")


@dataclass(frozen=True)
class Budget:
    """The GPU memory a plan must fit in, and where that figure comes from."""

    gpu_memory: int
    margin: float = DEFAULT_MARGIN
    source: str = "--gpu-memory"

    def __post_init__(self) -> None:
        if self.gpu_memory <= 0:
            raise ValueError(f"The GPU memory must be positive, got {self.gpu_memory} bytes.")
        if not 0 <= self.margin < 1:
            raise ValueError(f"The margin is a fraction of the GPU memory in [0, 1), got {self.margin}.")

    @property
    def usable(self) -> int:
        return int(self.gpu_memory * (1 - self.margin))

    def fits(self, peak: int) -> bool:
        return peak <= self.usable


def gpu_budget(gpu_memory_gib: float | None = None, margin: float = DEFAULT_MARGIN) -> Budget:
    """``gpu_memory_gib`` if given, else the local GPU's memory, else 80 GiB."""
    if gpu_memory_gib is not None:
        return Budget(int(gpu_memory_gib * GIB), margin, "--gpu-memory")
    if torch.cuda.is_available():
        properties = torch.cuda.get_device_properties(torch.cuda.current_device())
        return Budget(properties.total_memory, margin, f"the local GPU, {properties.name}")
    return Budget(int(DEFAULT_GPU_MEMORY_GIB * GIB), margin, "the default: no local GPU, set --gpu-memory")


@dataclass
class ComparisonRow:
    """One row of ``--compare``: a technique added, its peak at the configured length and its longest length."""

    name: str
    techniques: Techniques | None
    note: str = ""
    step: StepSimulation | None = None
    search: LengthSearch | None = None


@dataclass
class Planner:
    """Simulations of one configuration and its variants against one budget, each simulated once.

    Run in a process whose stand-in device is registered (see :mod:`lit_memtrain.planner.simulate`).
    ``progress`` receives a line per simulation, as it ends (the CLI prints them to stderr): what it was for, the
    techniques and length tried, the peak and whether it fits, the CPU time it took.
    """

    settings: PlanSettings
    budget: Budget
    progress: Callable[[str], None] = field(default=lambda line: print(line, file=sys.stderr, flush=True))
    _simulations: dict[tuple[Techniques, int], StepSimulation] = field(default_factory=dict)
    _searches: dict[Techniques, Future[_Searched]] = field(default_factory=dict)

    @contextlib.contextmanager
    def searches_in_parallel(self, find_max_length: bool, compare: bool) -> Iterator[None]:
        """Search the longest length of the configuration if ``find_max_length``, and of every ``--compare`` row if
        ``compare``, in worker processes, one per CPU core, while the context is open; :meth:`simulate`,
        :meth:`longest_length` and :meth:`comparison` then collect what they need from them.

        Why processes: each search is a chain of simulations, each one single-threaded and seconds to tens of
        seconds long; the rows are independent, so on 8 cores eight of them run at once. Why forked, and here:
        a worker is this process as it is before its first simulation (torch and the model code imported, the
        configuration read, no thread started), so it starts in milliseconds, where a new interpreter would import
        for seconds. Autograd cannot run on the stand-in device in a child forked after it was registered (its
        probe runs a backward), so enter this before :func:`~lit_memtrain.planner.simulate.stand_in_device`; each
        worker registers its own. Where the device is registered already, another thread runs, CUDA is initialised
        (reading the local GPU's memory does that: ``--gpu-memory`` avoids it), fork is not available (not Linux)
        or there is one core, everything runs in this process, as without the context. If
        this process fails or is interrupted, the workers are killed rather than left to finish their searches.
        :attr:`progress` is called in the worker that simulated (the command's prints to the stderr they share).
        """
        searches: dict[Techniques, tuple[str, str]] = {}  # purposes: the configured length's step, the rest
        if find_max_length:
            searches[techniques_of(self.settings)] = ("plan", "longest length")
        if compare:
            for name, techniques, _ in comparison_rows(self.settings):
                if techniques is not None:
                    searches.setdefault(techniques, (f"compare {name}", f"compare {name}"))
        workers = min(len(searches), len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1)
        alone = threading.active_count() == 1 and sys.platform == "linux" and not torch.cuda.is_initialized()
        if stand_in_device_registered() or workers < 2 or not alone:
            yield
            return
        context = multiprocessing.get_context("fork")
        started = context.SimpleQueue()  # each worker's pid, to kill them on an error
        executor = ProcessPoolExecutor(workers, context, initializer=_start_worker, initargs=(self, started))
        try:
            # The costliest rows (the most techniques) are last in the table: first in the queue.
            for techniques, purposes in reversed(searches.items()):
                self._searches[techniques] = executor.submit(_search, techniques, *purposes)
            yield
        except BaseException:
            while not started.empty():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(started.get(), signal.SIGKILL)
            raise
        finally:
            executor.shutdown(wait=True, cancel_futures=True)
            self._searches = {}

    def simulate(
        self, techniques: Techniques | None = None, max_length: int | None = None, purpose: str = "plan"
    ) -> StepSimulation:
        """One step with ``techniques`` (default: the configuration's own) and rows of ``max_length`` tokens;
        ``purpose`` names what it is for in the progress line."""
        techniques = techniques_of(self.settings) if techniques is None else techniques
        max_length = self.settings.max_length if max_length is None else max_length
        key = (techniques, max_length)
        if key not in self._simulations and techniques in self._searches and max_length == self.settings.max_length:
            searched = self._searches[techniques].result()
            if searched.step is None:
                raise ValueError(searched.refusal)
            self._simulations[key] = searched.step
        if key not in self._simulations:
            start = time.process_time()
            step = simulate_fit_step(with_techniques(self.settings, techniques), max_length)
            if self.settings.generation is not None:  # GRPO: the generation phase beside the training step
                from lit_memtrain.planner.generation import with_generation

                step = with_generation(step, self.settings, self.budget.gpu_memory)
            peak = step.memory.device_peak
            verdict = "fits" if self.budget.fits(peak) else "does not fit"
            self.progress(
                f"[{purpose}] {techniques.describe()} at {max_length:,} tokens per row: {peak / GIB:,.2f} GiB, "
                f"{verdict} ({time.process_time() - start:.1f} s CPU)"
            )
            self._simulations[key] = step
        return self._simulations[key]

    def longest_length(self, techniques: Techniques | None = None, purpose: str = "longest length") -> LengthSearch:
        """The longest ``max_length`` that fits the budget, to within 1% of it or 1,024 tokens, whichever is more (see
        :mod:`lit_memtrain.planner.search`)."""
        techniques = techniques_of(self.settings) if techniques is None else techniques
        configured = self.simulate(techniques, purpose=purpose)
        if techniques in self._searches:
            searched = self._searches[techniques].result()
            if searched.search is None:
                raise ValueError(searched.refusal)
            return searched.search
        return find_max_length(
            lambda length: self.simulate(techniques, length, purpose).memory.device_peak,
            self.budget.usable,
            start=self.settings.max_length,
            fixed=configured.memory.fixed,
        )

    def suggestion(self) -> dict[str, Any] | None:
        """What to add to the configuration so that it fits at its own length, or None if it already fits.

        Techniques are added in the order of :func:`~lit_memtrain.planner.techniques.suggestions`, each on top of
        the previous ones; the first combination that fits is the suggestion. A technique the model cannot take
        (a ``ValueError`` when simulated: ChunkedRMSNorm on Gemma's norms) is left out.
        """
        current = techniques_of(self.settings)
        if self.budget.fits(self.simulate(current).memory.device_peak):
            return None
        added: list[str] = []
        candidate = current
        for how, change in suggestions(self.settings):
            updated = change(candidate)
            if updated == candidate:
                continue
            try:
                step = self.simulate(updated, purpose="what to add")
            except ValueError:
                continue
            candidate = updated
            added.append(how)
            if self.budget.fits(step.memory.device_peak):
                return {"fits": True, "add": added, "peak_device_bytes": step.memory.device_peak}
        step = self.simulate(candidate)
        fixed = step.memory.fixed
        return {
            "fits": False,
            "add": added,
            "peak_device_bytes": step.memory.device_peak,
            "fixed_bytes": fixed,
        }

    def comparison(self) -> list[ComparisonRow]:
        """One row per technique added in turn (:func:`~lit_memtrain.planner.techniques.comparison_rows`); a row
        whose technique the model cannot take (a ``ValueError`` when simulated: ChunkedRMSNorm on Gemma's norms)
        says why instead."""
        rows = []
        for name, techniques, note in comparison_rows(self.settings):
            row = ComparisonRow(name, techniques, note)
            if techniques is not None:
                try:
                    row.step = self.simulate(techniques, purpose=f"compare {name}")
                except ValueError as error:
                    row.techniques, row.note = None, str(error)
                else:
                    row.search = self.longest_length(techniques, purpose=f"compare {name}")
            rows.append(row)
        return rows


@dataclass(frozen=True)
class _Searched:
    """What a worker sends back for one set of techniques: the configured length's step and the longest length, or
    why either could not be simulated (a ``ValueError``'s message; the step may have been simulated, the search not)."""

    step: StepSimulation | None = None
    search: LengthSearch | None = None
    refusal: str | None = None


_worker_planner: Planner | None = None


def _start_worker(planner: Planner, started: Any) -> None:
    global _worker_planner
    started.put(os.getpid())
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # Ctrl-C ends a worker at once, not after its search
    torch.set_num_threads(1)  # one worker per core, each simulating on one thread
    stand_in_device()
    _worker_planner = Planner(planner.settings, planner.budget, planner.progress)


def _search(techniques: Techniques, first: str, purpose: str) -> _Searched:
    """In a worker: the configured length's step (``first`` names it in the progress line) and the longest length."""
    assert _worker_planner is not None
    try:
        step = _worker_planner.simulate(techniques, purpose=first)
    except ValueError as error:
        return _Searched(refusal=str(error))
    try:
        return _Searched(step, _worker_planner.longest_length(techniques, purpose))
    except ValueError as error:
        return _Searched(step, refusal=str(error))


def breakdown(step: StepSimulation) -> dict[str, int]:
    """The device bytes at the peak, by kind; buffers and inputs are folded into ``other``."""
    at_peak = step.memory.device_at_peak
    result = {kind: at_peak.get(kind, 0) for kind in _BREAKDOWN}
    result["other"] = sum(size for kind, size in at_peak.items() if kind not in _BREAKDOWN)
    return result
