"""A stacked timeline of device memory from a CUDA memory snapshot, as a PNG.

Why: a peak-memory number says how much, not what. The timeline of a training step shows every allocation
as a band, stacked in the order the allocations were made, from the first allocation of forward to the end
of backward: saved activations pile up through forward and drain through backward, and the transient that
sets the peak (a logit chunk, a recomputed MLP) stands out. This is the kind of figure the TRL long-context
guide uses to compare techniques.

The input is the dict of ``torch.cuda.memory._snapshot()`` (what ``_dump_snapshot`` pickles, and what
pytorch.org/memory_viz reads): ``segments`` with their blocks at the end of the recording, and
``device_traces`` with one list of allocator events per device. Functions here are pure, so they are tested
on the CPU with synthetic snapshots.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["Allocation", "allocation_intervals", "render_memory_timeline"]

_MAX_POINTS = 4000


@dataclass(frozen=True)
class Allocation:
    """One allocation alive over the events ``[start, end)`` (indices into the alloc/free events)."""

    size: int
    start: int
    end: int
    label: str


def _label(frames: list[dict[str, Any]], size: int) -> str:
    """The innermost frame outside PyTorch's own files, which names the code that asked for the memory."""
    for frame in frames:
        filename = frame.get("filename", "")
        if "/torch/" not in filename and not filename.startswith("??"):
            return f"{frame.get('name', '?')} ({Path(filename).name}:{frame.get('line', 0)}), {size / 2**20:.1f} MiB"
    return f"{size / 2**20:.1f} MiB"


def _blocks_alive_at_end(snapshot: dict[str, Any], device: int) -> dict[int, dict[str, Any]]:
    alive = {}
    for segment in snapshot.get("segments", []):
        if segment.get("device", device) != device:
            continue
        address = segment["address"]
        for block in segment["blocks"]:
            if block["state"] == "active_allocated":
                alive[block.get("address", address)] = block
            address += block["size"]
    return alive


def allocation_intervals(snapshot: dict[str, Any], device: int = 0) -> tuple[list[Allocation], int]:
    """Every allocation of ``device`` during the recording, with its lifetime in event indices.

    Allocations made before the recording started count from event 0: those freed during the recording
    (the free event gives their size) and those still alive at its end (the snapshot's blocks).

    Returns:
        The allocations ordered by start, and the number of events (the end of the time axis).
    """
    traces = snapshot.get("device_traces", [])
    events = [e for e in (traces[device] if device < len(traces) else []) if e["action"] in ("alloc", "free_completed")]
    live: dict[int, tuple[int, int, str]] = {}
    seen: set[int] = set()
    allocations = []
    for index, event in enumerate(events):
        address, size = event["addr"], event["size"]
        seen.add(address)
        if event["action"] == "alloc":
            live[address] = (index, size, _label(event.get("frames", []), size))
        elif address in live:
            start, size, label = live.pop(address)
            allocations.append(Allocation(size, start, index, label))
        else:
            allocations.append(Allocation(size, 0, index, f"before the recording, {size / 2**20:.1f} MiB"))
    end = len(events)
    allocations.extend(Allocation(size, start, end, label) for start, size, label in live.values())
    for address, block in _blocks_alive_at_end(snapshot, device).items():
        if address not in seen:
            size = block.get("requested_size", block["size"])
            allocations.append(Allocation(size, 0, end, f"before the recording, {size / 2**20:.1f} MiB"))
    allocations.sort(key=lambda a: (a.start, -a.end))
    return allocations, end


def _live_bytes(allocations: list[Allocation], num_events: int) -> np.ndarray:
    """Total bytes alive after each event (difference array, O(allocations + events)); at least one value."""
    delta = np.zeros(num_events + 1, dtype=np.int64)
    for allocation in allocations:
        delta[allocation.start] += allocation.size
        delta[allocation.end] -= allocation.size
    return np.cumsum(delta)[: max(num_events, 1)]


def render_memory_timeline(
    snapshot: dict[str, Any],
    path: str | Path,
    device: int = 0,
    title: str = "Device memory over one training step",
    max_bands: int = 60,
) -> int:
    """Draw the allocations of ``snapshot`` stacked over time and write the figure to ``path`` (PNG).

    The allocations that make up the peak get their own band, largest first, up to ``max_bands`` (then the
    largest of the others); the ten first are named in the legend. The rest are summed into one grey band
    on top, so the outline is the exact total at every point drawn.

    Returns:
        The peak of allocated bytes over the recording, in bytes.
    """
    from matplotlib.figure import Figure

    allocations, num_events = allocation_intervals(snapshot, device)
    total = _live_bytes(allocations, num_events)
    peak_index = int(np.argmax(total))
    peak = int(total[peak_index])
    evenly_spaced = np.linspace(0, len(total) - 1, _MAX_POINTS).astype(np.int64)
    points = np.unique(np.append(evenly_spaced, peak_index))
    at_peak_first = sorted(allocations, key=lambda a: (a.start <= peak_index < a.end, a.size), reverse=True)
    largest = at_peak_first[:max_bands]
    bands = sorted(largest, key=lambda a: (a.start, -a.end))
    heights = np.array(
        [np.where((points >= a.start) & (points < a.end), a.size, 0) for a in bands], dtype=np.float64
    ).reshape(len(bands), len(points))
    other = total[points] - heights.sum(axis=0)
    gib = 2**30
    named = {id(a) for a in largest[:10]}
    figure = Figure(figsize=(15, 6), dpi=100)
    axes = figure.add_subplot()
    colours = [f"C{i % 10}" for i in range(len(bands))]
    labels = [a.label if id(a) in named else "_" for a in bands]
    axes.stackplot(
        points,
        *(heights / gib),
        np.clip(other, 0, None) / gib,
        colors=[*colours, "0.75"],
        labels=[*labels, "other allocations"],
        linewidth=0,
    )
    axes.axhline(peak / gib, color="black", linestyle="--", linewidth=0.8)
    axes.annotate(f"peak {peak / gib:.2f} GiB", (peak_index, peak / gib), textcoords="offset points", xytext=(4, 4))
    axes.set_xlabel("allocator events (alloc / free) during the step")
    axes.set_ylabel("allocated memory (GiB)")
    axes.set_title(title)
    axes.set_xlim(0, max(num_events - 1, 1))
    axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", frameon=False)
    figure.tight_layout()
    figure.savefig(path, format="png")
    return peak
