"""``results.run_isolated`` (benchmarks/gpu/results.py): each setting of a GPU part isolated from the others, run
from a script as ``python part.py``. By default in the part's own process once proven clean (the objects of the
previous setting gone, CUDA memory back at the floor), else in a fresh process; with ``GPU_CHECK_ISOLATION=process``
every setting in a fresh one, spawned as on a GPU machine (the script imported again in the child, the next child
started while a setting runs) or forked as in a dry run. CUDA's allocated bytes are played by a counter here."""

from __future__ import annotations

import json
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
import gc, json, os, sys, time
sys.path.insert(0, {gpu!r})
import results
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


def sets_a_variable_and_starts_a_process_group(port):
    import torch.distributed as dist

    os.environ["GPU_CHECK_TEST_VARIABLE"] = "set"  # as Lightning sets MASTER_PORT
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{{port}}", rank=0, world_size=1)


def what_it_finds():
    import torch.distributed as dist

    return {{"variable": os.environ.get("GPU_CHECK_TEST_VARIABLE"), "process group": dist.is_initialized()}}


def fails():
    model = Model()
    watch(model, "the model")
    raise ValueError("no such setting: 3")  # the traceback's frame keeps the model, unless the frames are freed


def hangs():
    time.sleep(60)


def main():
    first, second = (run_isolated(setting, 8, scale=0.5, timeout_s=60) for _ in range(2))
    print("FIGURE", first["figure"])
    print("PIDS", json.dumps([first["pid"], second["pid"], os.getpid()]))
    print("SCRIPT IMPORTED AGAIN", first["imported"] != STARTED)
    print("COLLECTED", run_isolated(freed_by_the_collector))
    import socket
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    run_isolated(sets_a_variable_and_starts_a_process_group, port)
    print("FOUND", json.dumps(run_isolated(what_it_finds)))
    try:
        run_isolated(leaks_through_a_cycle)
    except SettingLeaked as error:
        print("LEAK leaks_through_a_cycle", error)
    try:
        run_isolated(fails)
    except ValueError as error:
        cause = str(error.__cause__)
        print("RAISED", error, "|", error.__cause__ is None or ("line" in cause and "in fails" in cause))
        failure = error  # kept, with its traceback: the frames' locals are freed all the same
    print("FAILED SETTING FREED", [reference() is None for _, reference, _ in results._watched])
    start = time.perf_counter()
    try:
        run_isolated(hangs, timeout_s=2)
    except TimeoutError as error:
        print("TIMEOUT", error, time.perf_counter() - start < 20)
    try:
        run_isolated(leaks_through_a_global)
    except SettingLeaked as error:
        print("LEAK leaks_through_a_global", error)
    try:
        run_isolated(kept_despite_the_collector)
    except SettingLeaked as error:
        print("KEPT", error)
    results.write(results.Path(sys.argv[1]), summary="", tables=[])
    print("KEPT THE FAILURE", type(failure).__name__)


def after_a_global_leak_and_a_time_limit():
    try:
        run_isolated(leaks_through_a_global)
    except SettingLeaked:
        pass
    run_isolated(setting, 1)  # elsewhere: the leaked model is alive
    KEPT.clear()  # the leaked model freed: this process is clean again
    start = time.perf_counter()
    try:
        run_isolated(hangs, timeout_s=2)  # here: stopped by SIGALRM
    except TimeoutError as error:
        print("TIMEOUT", error, time.perf_counter() - start < 20)
    run_isolated(setting, 1)
    results.write(results.Path(sys.argv[1]), summary="", tables=[])


def after_a_setting_that_started_a_group_and_raised():
    import socket
    import torch.distributed as dist

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]

    try:
        run_isolated(starts_a_process_group_and_fails, port)
    except ValueError:
        pass
    run_isolated(setting, 1)  # elsewhere; this process is still released for it
    print("GROUP AFTER THE NEXT SETTING", dist.is_initialized())
    results.write(results.Path(sys.argv[1]), summary="", tables=[])


def turns_on_tf32():
    import torch

    torch.set_float32_matmul_precision("high")  # as TrainingArguments(tf32=True) does, for the rest of the process


def after_a_setting_that_changed_a_torch_flag():
    import torch  # noqa: F401 - imported before the first setting, as the GPU parts do

    run_isolated(setting, 1)
    run_isolated(turns_on_tf32)
    run_isolated(setting, 1)  # elsewhere: it would run with TF32 here
    results.write(results.Path(sys.argv[1]), summary="", tables=[])


def starts_a_process_group_and_fails(port):
    sets_a_variable_and_starts_a_process_group(port)
    raise ValueError("stopped part way")


if __name__ == "__main__":
    main() if len(sys.argv) == 2 else globals()[sys.argv[2]]()
"""


def _run_part(tmp_path: Path, *scenario: str, **environment: str) -> tuple[list[str], list[dict]]:
    script = tmp_path / "part.py"
    script.write_text(textwrap.dedent(PART.format(gpu=str(GPU))))
    out = tmp_path / "part.json"
    started = time.perf_counter()
    result = subprocess.run([sys.executable, str(script), str(out), *scenario], capture_output=True, text=True,
                            timeout=300, env=dict(os.environ, **environment))  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert time.perf_counter() - started < 60  # a spare child left at the end is killed, not waited for
    return result.stdout.splitlines(), json.loads(out.read_text())["settings"]


def _common_outcomes(lines: list[str]) -> None:
    assert "FIGURE 4.0" in lines
    assert "RAISED no such setting: 3 | True" in lines
    assert any(line.startswith("TIMEOUT hangs did not finish within 2 s") and line.endswith("True") for line in lines)
    assert "COLLECTED collected" in lines
    assert 'FOUND {"variable": null, "process group": false}' in lines  # neither outlives the setting that made them
    leaks = [line for line in lines if line.startswith("LEAK")]
    assert len(leaks) == 2, lines
    assert leaks[0].startswith("LEAK leaks_through_a_cycle ") and "the model (referred to by: " in leaks[0]
    assert leaks[1].startswith("LEAK leaks_through_a_global leaks_through_a_global returned but objects")
    assert "the model (referred to by: list)" in leaks[1]
    kept = [line for line in lines if line.startswith("KEPT kept_despite_the_collector returned but")]
    assert len(kept) == 1 and "the model (referred to by: list" in kept[0] and "after a garbage collection" in kept[0]


def test_settings_run_in_the_parts_process_while_proven_clean_and_in_a_fresh_one_after_a_raise(tmp_path):
    lines, settings = _run_part(tmp_path)
    _common_outcomes(lines)
    first, second, own = json.loads(next(line for line in lines if line.startswith("PIDS"))[5:])
    assert first == second == own
    assert "SCRIPT IMPORTED AGAIN False" in lines
    assert "FAILED SETTING FREED [True]" in lines  # the kept exception's frames no longer hold the model
    where = [(item["setting"], item["process"]) for item in settings]
    assert where == [("setting", "this one"), ("setting", "this one"), ("freed_by_the_collector", "this one"),
                     ("sets_a_variable_and_starts_a_process_group", "this one"), ("what_it_finds", "this one"),
                     ("leaks_through_a_cycle", "this one"), ("fails", "this one"), ("hangs", "fresh"),
                     ("leaks_through_a_global", "fresh"), ("kept_despite_the_collector", "fresh")]  # fmt: skip
    # The cycle's model was freed by the collector before the next setting, so the failing one ran here; once a
    # setting raised here, every later one runs elsewhere, with the reason.
    reason = "fails raised ValueError in this process, which may have left it changed"
    assert [item["detail"] for item in settings[7:]] == [reason] * 3
    assert all(item["seconds"] >= 0 for item in settings) and settings[7]["seconds"] < 20


def test_a_setting_left_alive_or_stopped_at_its_time_limit_sends_the_next_one_elsewhere(tmp_path):
    lines, settings = _run_part(tmp_path, "after_a_global_leak_and_a_time_limit")
    assert any(line.startswith("TIMEOUT hangs did not finish within 2 s (stopped in the part's own process)")
               and line.endswith("True") for line in lines), lines  # fmt: skip
    where = [(item["setting"], item["process"], item["detail"]) for item in settings]
    assert where == [
        ("leaks_through_a_global", "this one", "proven clean"),
        ("setting", "fresh", "the previous setting's the model (referred to by: list) still alive"),
        ("hangs", "this one", "proven clean"),
        ("setting", "fresh", "hangs raised TimeoutError in this process, which may have left it changed"),
    ]


def test_a_raised_setting_is_still_released_before_the_next_one_runs_elsewhere(tmp_path):
    """What the raised setting holds in this process (its process group here; on a GPU the allocator's cached
    blocks, which a fresh process's setting would otherwise find missing from the device) is given back."""
    lines, settings = _run_part(tmp_path, "after_a_setting_that_started_a_group_and_raised")
    assert [item["process"] for item in settings] == ["this one", "fresh"]
    assert "GROUP AFTER THE NEXT SETTING False" in lines


def test_a_setting_that_changed_a_torch_flag_sends_the_next_one_elsewhere(tmp_path):
    """No proof of memory sees TF32 turned on: the setting after it would be timed under it in this process."""
    lines, settings = _run_part(tmp_path, "after_a_setting_that_changed_a_torch_flag")
    assert [item["process"] for item in settings] == ["this one", "this one", "fresh"]
    assert settings[2]["detail"].startswith("turns_on_tf32 changed torch's process-wide settings (")
    assert "float32 matmul precision: highest -> high" in settings[2]["detail"]


@pytest.mark.parametrize("start_method", ["spawn", "fork"])
def test_with_isolation_process_every_setting_runs_in_a_fresh_process(tmp_path, start_method):
    lines, settings = _run_part(tmp_path, GPU_CHECK_ISOLATION="process", GPU_CHECK_START_METHOD=start_method)
    _common_outcomes(lines)
    assert len(set(json.loads(next(line for line in lines if line.startswith("PIDS"))[5:]))) == 3
    assert f"SCRIPT IMPORTED AGAIN {start_method == 'spawn'}" in lines
    assert {item["process"] for item in settings} == {"fresh"}
    assert all(item["detail"] == "GPU_CHECK_ISOLATION=process" for item in settings)
    assert all("setting_s" in item for item in settings if item["setting"] == "setting")


CUDA_PART = """
import os, sys
sys.path.insert(0, {gpu!r})
import results
from results import run_isolated

# CUDA's allocated bytes, played by counters: the libraries' workspaces and what settings leave.
WORKSPACES, LEFT = [0], [0]


def allocated():
    return WORKSPACES[0] + LEFT[0]


results._cuda_allocated = allocated
results._library_floor = lambda: WORKSPACES.__setitem__(0, 100) or allocated()  # made (again): 100 bytes
results._release = lambda: None
os.register_at_fork(after_in_child=lambda: (WORKSPACES.__setitem__(0, 0), LEFT.__setitem__(0, 0)))  # nothing there


def allocates(left):
    LEFT[0] += left  # what the setting leaves allocated (the counters live in each process)
    return allocated()


def frees_the_workspaces():
    WORKSPACES[0] = 0  # as every Lightning fit on a GPU ends (torch._C._cuda_clearCublasWorkspaces)
    return allocated()


if __name__ == "__main__":
    print("RESULTS", [run_isolated(allocates, left) for left in (0, 0, 5, 0)], allocated())
    LEFT[0] = 0  # the 5 bytes are freed
    print("AFTER", run_isolated(allocates, 0), run_isolated(frees_the_workspaces), run_isolated(allocates, 0))
    results.write(results.Path(sys.argv[1]), summary="", tables=[])
"""


def test_memory_off_the_floor_sends_the_next_setting_to_a_fresh_process(tmp_path):
    script = tmp_path / "part.py"
    script.write_text(textwrap.dedent(CUDA_PART.format(gpu=str(GPU))))
    out = tmp_path / "part.json"
    result = subprocess.run([sys.executable, str(script), str(out)], capture_output=True, text=True, timeout=120,
                            env=dict(os.environ, GPU_CHECK_START_METHOD="fork"))  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    # The first setting finds 0 allocated, makes the floor (100) and runs here; the third leaves 5 bytes, so the
    # fourth runs in a fresh process (which starts with nothing allocated); once back at 100, here again. A setting
    # that frees the workspaces (a Lightning fit) leaves the process clean: they are made again before the next.
    assert "RESULTS [100, 100, 105, 0] 105" in result.stdout
    assert "AFTER 100 0 100" in result.stdout
    settings = json.loads(out.read_text())["settings"]
    assert [item["process"] for item in settings] == ["this one"] * 3 + ["fresh"] + ["this one"] * 3
    assert settings[0]["detail"] == "proven clean: 100 bytes allocated, the floor"
    assert settings[3]["detail"] == ("105 bytes of CUDA memory allocated where this process started its settings with "
                                     "100 (the libraries' own)")  # fmt: skip


LIGHTNING_PART = """
import sys
sys.path.insert(0, {gpu!r})
import torch
import results
from results import run_isolated, watch

KEPT = []


def fit(offload, keep_a_tensor=False):
    from lightning.pytorch import Trainer
    from torch.utils.data import DataLoader

    from lit_memtrain.callbacks import ActivationOffloading
    from lit_memtrain.objectives.causal_lm import CausalLMModule

    pinned = torch.cuda.host_memory_stats()
    found = {{"allocated": torch.cuda.memory_allocated(), "pinned in use": pinned["active_bytes.current"],
              "pinned cached": pinned["allocated_bytes.current"]}}
    torch.manual_seed(0)
    ids = torch.randint(0, 100, (1, 256))
    module = CausalLMModule(preset="tiny-qwen3")
    watch(module, "the module", after_collection=True)
    trainer = Trainer(accelerator="gpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                      callbacks=[ActivationOffloading(min_offload_bytes=0)] if offload else [])
    trainer.fit(module, DataLoader([{{"input_ids": ids, "labels": ids}}] * 2, batch_size=None))
    if keep_a_tensor:
        KEPT.append(torch.ones(1024, device="cuda"))  # not watched: only the memory proof can see it
    found["pinned after the fit"] = torch.cuda.host_memory_stats()["allocated_bytes.current"]
    return found


if __name__ == "__main__":
    found = [run_isolated(fit, offload) for offload in (False, True, False)]
    found.append(run_isolated(fit, False, keep_a_tensor=True))
    found.append(run_isolated(fit, False))
    print("FOUND", found)
    results.write(results.Path(sys.argv[1]), summary="", tables=[])
"""


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_cuda_lightning_fits_run_in_the_parts_process_once_proven_clean(tmp_path):
    """The CUDA half of the proof, through real fits: Lightning frees the cuBLAS workspaces at each fit's start and
    end and starts a process group; the offloading fit leaves pinned host blocks cached. Each fit after the first
    still finds the process at the floor, with no pinned host memory, and runs here; after a fit that keeps a
    tensor on the GPU, the next runs in a fresh process."""
    script = tmp_path / "part.py"
    script.write_text(textwrap.dedent(LIGHTNING_PART.format(gpu=str(GPU))))
    out = tmp_path / "part.json"
    result = subprocess.run([sys.executable, str(script), str(out)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    settings = json.loads(out.read_text())["settings"]
    import torch

    assert [item["process"] for item in settings] == ["this one"] * 4 + ["fresh"], settings
    assert settings[-1]["detail"].startswith("4,096 bytes of CUDA memory allocated where this process started")
    found = eval(next(line for line in result.stdout.splitlines() if line.startswith("FOUND"))[6:])
    floor = found[0]["allocated"]
    assert floor > 0 and [item["allocated"] for item in found] == [floor] * 4 + [0]
    assert found[1]["pinned after the fit"] > 0  # the offloading fit copied through pinned blocks
    assert [item["pinned in use"] for item in found] == [0] * 5  # nothing of the offloading fit holds any
    if hasattr(torch.accelerator, "empty_host_cache"):  # torch 2.13 (not 2.11): its cached blocks given back too
        assert [item["pinned cached"] for item in found] == [0] * 5
