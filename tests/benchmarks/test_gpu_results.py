"""``results.run_isolated`` (benchmarks/gpu/results.py): each setting of a GPU part in a fresh process of its own,
run from a script as ``python part.py``: spawned as on a GPU machine (the script is imported again in the child,
and the next child started while a setting runs) and forked as in a dry run."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / "benchmarks" / "gpu"

PART = """
import os, sys, time
sys.path.insert(0, {gpu!r})
from results import SettingLeaked, run_isolated, watch

KEPT = []
STARTED = time.time()


class Model:
    def forward(self, x):
        return x


def setting(seq_len, *, scale=1.0):
    model = Model()
    watch(model, "the model")
    return {{"pid": os.getpid(), "figure": seq_len * scale, "imported": STARTED}}


def leaks_through_a_global():
    model = Model()
    watch(model, "the model")
    KEPT.append(model)


def leaks_through_a_cycle():
    model = Model()
    model.forward = lambda x, model=model: x  # a closure over the model, stored on the model
    watch(model, "the model")


def freed_by_the_collector():
    model = Model()
    model.forward = lambda x, model=model: x
    watch(model, "the model", after_collection=True)  # a library's cycle: allowed, collected
    return "collected"


def kept_despite_the_collector():
    model = Model()
    model.forward = lambda x, model=model: x
    watch(model, "the model", after_collection=True)
    KEPT.append(model)


def fails():
    raise ValueError("no such setting: 3")


def hangs():
    time.sleep(60)


if __name__ == "__main__":
    first, second = (run_isolated(setting, 8, scale=0.5, timeout_s=60) for _ in range(2))
    assert first["figure"] == 4.0 and len({{first["pid"], second["pid"], os.getpid()}}) == 3, (first, second)
    print("SCRIPT IMPORTED AGAIN", first["imported"] != STARTED)
    for leaking in (leaks_through_a_global, leaks_through_a_cycle):
        try:
            run_isolated(leaking)
        except SettingLeaked as error:
            print("LEAK", leaking.__name__, error)
    print("COLLECTED", run_isolated(freed_by_the_collector))
    try:
        run_isolated(kept_despite_the_collector)
    except SettingLeaked as error:
        print("KEPT", error)
    try:
        run_isolated(fails)
    except ValueError as error:
        print("RAISED", error, "|", "line" in str(error.__cause__) and "in fails" in str(error.__cause__))
    start = time.perf_counter()
    try:
        run_isolated(hangs, timeout_s=2)
    except TimeoutError as error:
        print("TIMEOUT", error, time.perf_counter() - start < 20)
"""


@pytest.mark.parametrize("start_method", ["spawn", "fork"])
def test_run_isolated_runs_each_setting_in_a_fresh_process_and_reports_leaks_errors_and_hangs(tmp_path, start_method):
    script = tmp_path / "part.py"
    script.write_text(textwrap.dedent(PART.format(gpu=str(GPU))))
    started = time.perf_counter()
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                            env=dict(os.environ, GPU_CHECK_START_METHOD=start_method))  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert time.perf_counter() - started < 60  # the spare child left at the end is killed, not waited for
    lines = result.stdout.splitlines()
    assert f"SCRIPT IMPORTED AGAIN {start_method == 'spawn'}" in lines
    leaks = [line for line in lines if line.startswith("LEAK")]
    assert len(leaks) == 2, result.stdout
    assert leaks[0].startswith("LEAK leaks_through_a_global leaks_through_a_global returned but objects")
    assert "the model (referred to by: list)" in leaks[0]
    assert leaks[1].startswith("LEAK leaks_through_a_cycle ") and "the model (referred to by: " in leaks[1]
    assert "COLLECTED collected" in lines
    kept = [line for line in lines if line.startswith("KEPT kept_despite_the_collector returned but")]
    assert len(kept) == 1 and "the model (referred to by: list, tuple), after a garbage collection" in kept[0], kept
    assert "RAISED no such setting: 3 | True" in lines
    assert any(line.startswith("TIMEOUT hangs did not finish within 2 s") and line.endswith("True") for line in lines)
