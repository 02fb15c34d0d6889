"""MemoryMonitor: per-step memory metrics, the snapshot of one chosen step, and the timeline renderer."""

from __future__ import annotations

import pickle
from types import SimpleNamespace

import lightning as L
import pytest
import torch

from lit_memtrain.callbacks.memory_monitor import MemoryMonitor
from lit_memtrain.techniques.memory_timeline import allocation_intervals, render_memory_timeline

MIB = 2**20


def _frames(name):
    return [
        {"filename": "/site-packages/torch/nn/functional.py", "line": 10, "name": "linear"},
        {"filename": "/home/me/model.py", "line": 42, "name": name},
    ]


def _snapshot():
    """Allocator history of a small step: a block from before the recording that stays (100 MiB), one from
    before that is freed (20 MiB), and A, B, C allocated and freed during the recording."""
    trace = [
        {"action": "alloc", "addr": 1000, "size": 50 * MIB, "frames": _frames("forward_a")},
        {"action": "segment_alloc", "addr": 9000, "size": 64 * MIB, "frames": []},
        {"action": "alloc", "addr": 2000, "size": 30 * MIB, "frames": _frames("forward_b")},
        {"action": "free_requested", "addr": 1000, "size": 50 * MIB, "frames": []},
        {"action": "free_completed", "addr": 1000, "size": 50 * MIB, "frames": []},
        {"action": "free_completed", "addr": 500, "size": 20 * MIB, "frames": []},
        {"action": "alloc", "addr": 3000, "size": 70 * MIB, "frames": _frames("backward_c")},
        {"action": "free_completed", "addr": 3000, "size": 70 * MIB, "frames": []},
    ]
    segments = [
        {
            "device": 0,
            "address": 0,
            "total_size": 400 * MIB,
            "blocks": [
                {"address": 0, "size": 100 * MIB, "requested_size": 100 * MIB, "state": "active_allocated"},
                {"address": 100 * MIB, "size": 300 * MIB, "state": "inactive"},
            ],
        }
    ]
    return {"segments": segments, "device_traces": [trace]}


def test_allocation_intervals_follow_the_trace():
    allocations, num_events = allocation_intervals(_snapshot())
    assert num_events == 6  # alloc and free_completed events only
    assert [(a.size // MIB, a.start, a.end) for a in allocations] == [
        (100, 0, 6),  # alive before and after the recording
        (20, 0, 3),  # allocated before the recording, freed during it
        (50, 0, 2),
        (30, 1, 6),  # never freed: alive to the end
        (70, 4, 5),
    ]
    assert allocations[2].label == "forward_a (model.py:42), 50.0 MiB"


def test_render_writes_png_and_returns_exact_peak(tmp_path):
    path = tmp_path / "timeline.png"
    peak = render_memory_timeline(_snapshot(), path)
    # After B is allocated: 100 + 20 + 50 + 30 MiB.
    assert peak == 200 * MIB
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_render_sums_allocations_beyond_max_bands_into_one_band(tmp_path):
    trace = [{"action": "alloc", "addr": i, "size": (i + 1) * MIB, "frames": []} for i in range(300)]
    trace += [{"action": "free_completed", "addr": i, "size": (i + 1) * MIB, "frames": []} for i in range(300)]
    peak = render_memory_timeline({"segments": [], "device_traces": [trace]}, tmp_path / "many.png", max_bands=5)
    assert peak == sum(range(1, 301)) * MIB
    assert (tmp_path / "many.png").stat().st_size > 0


def test_allocation_intervals_of_a_device_without_trace():
    assert allocation_intervals({"segments": [], "device_traces": []}, device=1) == ([], 0)


class _TinyModule(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_logs_process_rss_on_cpu_to_logger_and_progress_bar():
    import psutil

    class ReadRss(L.Callback):  # right after MemoryMonitor reads it: the same RSS, give or take a few MB
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.rss_gib = psutil.Process().memory_info().rss / 2**30

    read = ReadRss()
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=2,
        callbacks=[MemoryMonitor(), read],
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(_TinyModule(), torch.utils.data.DataLoader(torch.randn(4, 8), batch_size=2))
    assert float(trainer.callback_metrics["memory/rss_gib"]) == pytest.approx(read.rss_gib, rel=0.02)
    assert "memory/rss_gib" in trainer.progress_bar_metrics


def test_snapshot_on_cpu_warns():
    monitor = MemoryMonitor(snapshot_step=0, snapshot_dir="unused")
    with pytest.warns(UserWarning, match="no snapshot will be written"):
        monitor.on_fit_start(SimpleNamespace(), _TinyModule())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"snapshot_step": 2}, "needs snapshot_dir"),
        ({"snapshot_step": -1, "snapshot_dir": "x"}, "snapshot_step must be an int >= 0"),
        ({"max_snapshot_entries": 0}, "max_snapshot_entries must be >= 1"),
    ],
)
def test_invalid_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MemoryMonitor(**kwargs)


class _FakeCudaMemory:
    """Stands in for torch.cuda's counters and history recorder, to test the step logic without a GPU."""

    def __init__(self, monkeypatch):
        self.calls = []
        self.recording = False
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: self.calls.append("reset"))
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 3 * 2**30)
        monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: 4 * 2**30)
        monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", self.record)
        monkeypatch.setattr(torch.cuda.memory, "_snapshot", lambda device=None: _snapshot())

    def record(self, enabled="all", **kwargs):
        self.recording = enabled is not None
        self.calls.append("record" if self.recording else "stop")


def test_snapshot_spans_every_micro_batch_of_the_chosen_step(monkeypatch, tmp_path):
    cuda = _FakeCudaMemory(monkeypatch)
    logged = []
    module = SimpleNamespace(
        device=torch.device("cuda", 0), log_dict=lambda metrics, **kwargs: logged.append((metrics, kwargs))
    )
    trainer = SimpleNamespace(global_step=0)
    monitor = MemoryMonitor(snapshot_step=1, snapshot_dir=tmp_path)
    # global_step after each batch: step 1 spans batches 2 and 3 (two micro-batches).
    for batch_idx, step_after in enumerate([0, 1, 1, 2, 3, 3]):
        monitor.on_train_batch_start(trainer, module, None, batch_idx)
        trainer.global_step = step_after
        monitor.on_train_batch_end(trainer, module, None, None, batch_idx)
    # The peak counters are reset at each step's first micro-batch (steps 0 and 1 have two, steps 2 and 3 one).
    assert cuda.calls == ["reset", "reset", "record", "stop", "reset", "reset"]
    assert logged[0] == (
        {"memory/peak_allocated_gib": 3.0, "memory/peak_reserved_gib": 4.0},
        {"prog_bar": True, "on_step": True, "on_epoch": False, "batch_size": 1},
    )
    pickle_path, png_path = monitor.snapshot_paths
    assert pickle_path == tmp_path / "memory_snapshot_step1.pickle"
    assert pickle.loads(pickle_path.read_bytes()) == _snapshot()
    assert png_path.read_bytes()[:4] == b"\x89PNG"


cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@cuda_only
def test_cuda_logs_peaks_and_writes_snapshot(tmp_path):
    monitor = MemoryMonitor(snapshot_step=1, snapshot_dir=tmp_path)
    trainer = L.Trainer(
        accelerator="cuda",
        devices=1,
        max_steps=3,
        callbacks=[monitor],
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(_TinyModule(), torch.utils.data.DataLoader(torch.randn(6, 8), batch_size=2))
    assert float(trainer.callback_metrics["memory/peak_allocated_gib"]) > 0
    assert float(trainer.callback_metrics["memory/peak_reserved_gib"]) >= float(
        trainer.callback_metrics["memory/peak_allocated_gib"]
    )
    pickle_path, png_path = monitor.snapshot_paths
    assert pickle.loads(pickle_path.read_bytes())["device_traces"]
    assert png_path.stat().st_size > 0


def test_the_peak_logged_for_an_optimizer_step_covers_all_its_micro_batches(monkeypatch):
    """Under gradient accumulation Lightning passes to the logger only what is logged at a step's last micro-batch;
    that value must be the peak of the whole step, though a step's largest micro-batch came first."""
    cuda = _FakeCudaMemory(monkeypatch)
    peak = {"bytes": 0}
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: peak.update(bytes=0))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: peak["bytes"])
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: peak["bytes"])
    logged = []
    module = SimpleNamespace(device=torch.device("cuda", 0), log_dict=lambda metrics, **kwargs: logged.append(metrics))
    trainer = SimpleNamespace(global_step=0)
    monitor = MemoryMonitor()
    # Two optimizer steps of two micro-batches each: step 0 peaks at 6 GiB in its first micro-batch, step 1 at 2 GiB.
    for batch_idx, (gib, step_after) in enumerate([(6, 0), (1, 1), (2, 1), (1, 2)]):
        monitor.on_train_batch_start(trainer, module, None, batch_idx)
        peak["bytes"] = max(peak["bytes"], gib * 2**30)
        trainer.global_step = step_after
        monitor.on_train_batch_end(trainer, module, None, None, batch_idx)
    step_ends = [logged[1], logged[3]]  # what reaches the logger: the last micro-batch of each step
    assert [metrics["memory/peak_allocated_gib"] for metrics in step_ends] == [6.0, 2.0]
    assert [metrics["memory/peak_reserved_gib"] for metrics in step_ends] == [6.0, 2.0]
    assert cuda.calls == []  # no history recorded without snapshot_step
