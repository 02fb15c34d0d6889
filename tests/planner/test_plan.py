"""`lit-memtrain plan` and the fit-step simulation behind it, on small configurations.

Sizes are checked against hand computation: a tiny Qwen3 (hidden 64, vocabulary 512, tied embeddings) with
P parameters in 24 tensors, fp32, one row of L = 8192 tokens, two accumulated micro-batches (so the
previous micro-batch's gradients are alive through the whole step). Simulations and `lit-memtrain plan` run in
child processes of ``preloaded_python`` (tests/conftest.py): the stand-in device must be registered before a
process's first backward. The two longest start early, in the background.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

L, H, TENSORS = 8192, 64, 24
FP32 = 4
TINY = [
    "--config", "configs/quickstart.yaml", "--model.preset=tiny-qwen3",
    "--model.config_overrides={vocab_size: 512, num_hidden_layers: 2, hidden_size: 64, intermediate_size: 128, "
    "num_attention_heads: 4, num_key_value_heads: 2, head_dim: 16}",
    "--data.batch_size=1",
]  # fmt: skip

_SIMULATIONS = """
import json
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from lit_memtrain.planner.simulate import stand_in_device
device = stand_in_device()
from lit_memtrain.planner.plan import Budget, Planner, breakdown
from lit_memtrain.planner.settings import CallbackSpec, PlanSettings, StrategySpec
from lit_memtrain.planner.tracker import MemoryTracker

CHECKPOINTING = "lit_memtrain.callbacks.GradientCheckpointing"

def settings(layers, **changes):
    values = dict(
        module={"preset": "tiny-qwen3", "config_overrides": {"vocab_size": 512, "num_hidden_layers": layers}},
        callbacks=(CallbackSpec(CHECKPOINTING),), max_length=8192, accumulate_grad_batches=2,
    )
    return PlanSettings(**{**values, **changes})

def report(planner_settings):
    step = Planner(planner_settings, Budget(2**40), progress=lambda line: None).simulate()
    return {"peak": step.memory.device_peak, "host": step.memory.host_at_peak, "phase": step.memory.phase,
            "breakdown": breakdown(step), "parameters": step.parameters, "notes": step.notes,
            "attention": step.attention}

results = {name: report(value) for name, value in {
    "two": settings(2),
    "three": settings(3),
    "three_offloaded": settings(3, callbacks=(CallbackSpec(CHECKPOINTING, {"offload": True}),)),
    "three_ddp": settings(3, strategy=StrategySpec("ddp", 2, "ddp")),
    "bf16_true": settings(2, precision="bf16-true"),
    "one_micro_batch": settings(2, accumulate_grad_batches=1),
}.items()}

budgets = [0.045, 0.06, 0.1, 0.2]
peaks = {}
lengths = []
for gib in budgets:
    planner = Planner(settings(2), Budget(int(gib * 2**30), margin=0.0), progress=lambda line: None)
    search = planner.longest_length()
    lengths.append(search.max_length)
    peaks[gib] = {str(length): peak for length, peak in search.peaks.items()}
results["search"] = {"budgets": budgets, "lengths": lengths, "peaks": peaks}

# CUDA's autocast on the stand-in device: matmuls in bf16, one cached bf16 copy of a weight per region.
with FakeTensorMode(allow_non_fake_inputs=True):
    weight = torch.empty(1024, 1024, device=device, requires_grad=True)
    x = torch.empty(8, 1024, device=device)
    tracker = MemoryTracker()
    tracker.track_external(weight, x)
    with tracker:
        with torch.autocast("gpu", dtype=torch.bfloat16):
            first, second = F.linear(x, weight), F.linear(x, weight)
            inside = tracker.total(device)
        after = tracker.total(device)
    results["autocast"] = {"dtypes": [str(first.dtype), str(second.dtype)], "inside": inside, "after": after}
print(json.dumps(results))
"""


SIMULATIONS = ("-c", _SIMULATIONS)


_IN_PARALLEL_AND_ONE_BY_ONE = """
import contextlib, json, os, sys, time
import lit_memtrain.planner.plan as plan
from lit_memtrain.cli.plan import read_fit_config
from lit_memtrain.planner.simulate import MemoryReport, stand_in_device
from lit_memtrain.planner.step import StepSimulation

def simulate_fit_step(settings, max_length):
    # A peak affine in the length, different per set of techniques; the process that computed it, in its notes.
    time.sleep(0.05)  # long enough for every worker to take a search
    key = sum(map(ord, repr(sorted(spec.class_path for spec in settings.callbacks))))
    peak = 2**20 + (64 + key % 97) * max_length
    memory = MemoryReport(peak, 0, {"activations": peak}, 2**20, "forward")
    return StepSimulation(memory, max_length, 1, 1, 2, 512, (str(os.getpid()),), "sdpa_by_document")

settings = read_fit_config(json.loads(sys.argv[1]))
budget = plan.Budget(2**30)
results = []

# An error in this process while the workers search: they are killed, not waited for (each simulation takes 2 s).
plan.simulate_fit_step = lambda settings, max_length: time.sleep(2) or simulate_fit_step(settings, max_length)
start = time.monotonic()
with contextlib.suppress(KeyError):
    with plan.Planner(settings, budget).searches_in_parallel(find_max_length=True, compare=True):
        time.sleep(0.5)
        raise KeyError("stop")
stopped_after = time.monotonic() - start
try:
    os.waitpid(-1, os.WNOHANG)
    children_left = True
except ChildProcessError:
    children_left = False

plan.simulate_fit_step = simulate_fit_step
for parallel in (True, False):  # forked workers first: they must start before this process registers its device
    lines = []
    planner = plan.Planner(settings, budget, progress=lines.append)
    searching = planner.searches_in_parallel(find_max_length=True, compare=True)
    with searching if parallel else contextlib.nullcontext():
        stand_in_device()
        rows = planner.comparison()
        configured = planner.simulate()
        search = planner.longest_length()
    results.append({
        "rows": [(row.name, row.step and row.step.memory.device_peak, row.search and row.search.peaks, row.note)
                 for row in rows],
        "search": [search.max_length, search.too_long, search.peaks],
        "processes": sorted({int(pid) for row in rows if row.step for pid in row.step.notes} - {os.getpid()}),
        "configured_here": configured.notes == (str(os.getpid()),),
        "lines_here": len(lines),
    })
print(json.dumps([*results, {"stopped_after": stopped_after, "children_left": children_left}]))
"""


def test_searches_in_worker_processes_find_what_one_process_finds(preloaded_python):
    """The plumbing of the workers (which search runs where, what comes back), with a stand-in simulation; the real
    one is the same code in a forked process."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one CPU core: the searches run in this process, as one_by_one")
    result = preloaded_python.run("-c", _IN_PARALLEL_AND_ONE_BY_ONE, json.dumps([*TINY, "--data.max_length=4096"]))
    assert result.returncode == 0, result.stderr[-3000:]
    parallel, one_by_one, stopped = json.loads(result.stdout.strip().splitlines()[-1])
    assert stopped["stopped_after"] < 1.5 and not stopped["children_left"]  # killed mid-simulation, and reaped
    assert parallel["rows"] == one_by_one["rows"] and parallel["search"] == one_by_one["search"]
    assert sum(row[1] is not None for row in parallel["rows"]) >= 6 and parallel["search"][0] > 0
    assert 1 < len(parallel["processes"]) <= len(os.sched_getaffinity(0))  # one worker per core, all used
    assert not parallel["configured_here"]  # the configured search, too, ran in a worker
    assert parallel["lines_here"] == 0 and one_by_one["lines_here"] > 6 and one_by_one["configured_here"]


def _compare_and_plot(directory: Path) -> tuple[str, ...]:
    return (
        "-m", "lit_memtrain.cli", "plan", *TINY, "--data.max_length=4096", "--gpu-memory=0.05", "--find-max-length",
        "--compare", "--plot", str(directory / "lengths.png"), "--json",
    )  # fmt: skip


def start_early(python) -> None:
    """Queued when collection ends (tests/conftest.py): the simulations, and the CLI with every option."""
    python.start(*SIMULATIONS)
    python.start(*_compare_and_plot(python.directory))


@pytest.fixture(scope="module")
def simulated(preloaded_python) -> dict:
    result = preloaded_python.run(*SIMULATIONS)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_fixed_memory_is_parameters_gradients_and_adamw_state_exactly(simulated):
    for name in ("two", "three"):
        report = simulated[name]
        parameters, kinds = report["parameters"], report["breakdown"]
        assert kinds["parameters"] == FP32 * parameters
        assert kinds["gradients"] == FP32 * parameters  # the earlier micro-batch's, accumulated in place
        # Fused AdamW: two fp32 moments per parameter and a 4-byte step counter per tensor, on the device.
        tensors = TENSORS if name == "two" else TENSORS + 11
        assert kinds["optimizer_state"] == 2 * FP32 * parameters + 4 * tensors
        assert sum(kinds.values()) == report["peak"]


def test_each_checkpointed_layer_keeps_its_input(simulated):
    two, three = simulated["two"], simulated["three"]
    assert (two["phase"], three["phase"]) == ("backward, decoder layer 1", "backward, decoder layer 2")
    assert three["breakdown"]["activations"] - two["breakdown"]["activations"] == L * H * FP32


def test_offloaded_checkpoints_hold_every_layer_input_on_the_host(simulated):
    offloaded, on_device = simulated["three_offloaded"], simulated["three"]
    assert offloaded["host"]["activations"] == 3 * L * H * FP32
    assert on_device["breakdown"]["activations"] - offloaded["breakdown"]["activations"] == 3 * L * H * FP32


def test_the_plan_assumes_the_attention_fit_chooses_on_a_cuda_gpu(simulated):
    """None named: fit on CUDA takes torch's varlen kernel per packed row (flash-attn's where it is installed)."""
    import importlib.util

    expected = "flash_attention_2" if importlib.util.find_spec("flash_attn") else "varlen_by_document"
    assert simulated["two"]["attention"] == expected
    assert f"Attention: {expected!r}, what fit chooses on a CUDA GPU when none is named." in simulated["two"]["notes"]
    assert not any("dense L x L mask" in note for note in simulated["two"]["notes"])  # sdpa's, assumed before


def test_a_named_attention_is_planned_as_named():
    from lit_memtrain.planner.settings import PlanSettings
    from lit_memtrain.planner.simulate import meta_causal_lm
    from lit_memtrain.planner.step import planned_attention

    model = meta_causal_lm("tiny-qwen3")
    named = PlanSettings(module={"preset": "tiny-qwen3", "attn_implementation": "sdpa"})
    assert planned_attention(named, model) == "sdpa"
    unnamed = PlanSettings(module={"preset": "tiny-qwen3"}, precision="bf16-true")
    assert planned_attention(unnamed, model) in ("varlen_by_document", "flash_attention_2")


_REPEATED_KEY_VALUE_HEADS = """
import json, sys
import lit_memtrain.techniques.attention as attention
from lit_memtrain.planner.plan import Budget, Planner
from lit_memtrain.planner.settings import PlanSettings

kernel, causal, _ = attention._VARLEN_KERNEL or (None, {}, True)
results = {}
for takes_groups in (True, False):  # a varlen_attn with enable_gqa (torch 2.13), and one without (torch 2.11)
    attention._VARLEN_KERNEL = (kernel, causal, takes_groups)
    settings = PlanSettings(module={"preset": "tiny-qwen3", "config_overrides": {"num_hidden_layers": 3}},
                            precision="bf16-true", max_length=4096)
    step = Planner(settings, Budget(2**40), progress=lambda line: None).simulate()
    results[str(takes_groups)] = {"peak": step.memory.device_peak, "attention": step.attention,
                                  "notes": list(step.notes)}
print(json.dumps(results))
"""


def test_varlen_without_grouped_heads_is_planned_with_the_repeated_key_and_value_the_fit_keeps(preloaded_python):
    """Under a torch whose varlen_attn takes no enable_gqa, varlen_by_document repeats the key/value heads (2 -> 4
    here) and each layer keeps the repeated ones for its backward: 3 layers x (key + value) x 4096 tokens x 2 more
    heads x 16 dimensions x 2 bytes more at the peak, and a note saying so."""
    import importlib.util

    if importlib.util.find_spec("flash_attn"):
        pytest.skip("with flash-attn installed, fit chooses flash_attention_2, not varlen_by_document")
    result = preloaded_python.run("-c", _REPEATED_KEY_VALUE_HEADS)
    assert result.returncode == 0, result.stderr[-3000:]
    grouped, repeated = (json.loads(result.stdout.strip().splitlines()[-1])[key] for key in ("True", "False"))
    assert grouped["attention"] == repeated["attention"] == "varlen_by_document"
    assert repeated["peak"] - grouped["peak"] == 3 * 2 * 4096 * (4 - 2) * 16 * 2
    note = [note for note in repeated["notes"] if "takes no grouped key/value heads" in note]
    assert len(note) == 1 and "repeats the 2 key and value heads to 4 in every layer" in note[0]
    assert not any("grouped key/value" in note for note in grouped["notes"])


def test_ddp_adds_one_copy_of_the_gradients(simulated):
    ddp, single = simulated["three_ddp"], simulated["three"]
    assert ddp["breakdown"]["gradients"] == 2 * single["breakdown"]["gradients"]
    assert ddp["peak"] - single["peak"] == single["breakdown"]["gradients"]
    assert "DDP (2 ranks)" in ddp["notes"][0]


def test_bf16_true_halves_the_fixed_memory(simulated):
    bf16, fp32 = simulated["bf16_true"]["breakdown"], simulated["two"]["breakdown"]
    for kind in ("parameters", "gradients"):
        assert 2 * bf16[kind] == fp32[kind]


def test_without_accumulation_the_previous_gradients_are_freed_before_backward(simulated):
    """Lightning zeroes the gradients after training_step: at a backward peak only the gradients of layers
    already back-propagated exist (here the last layer's and the tied head's)."""
    one, two = simulated["one_micro_batch"]["breakdown"], simulated["two"]["breakdown"]
    assert one["gradients"] < two["gradients"] / 10
    assert one["activations"] == two["activations"]


def test_max_length_grows_with_the_gpu_memory(simulated):
    search = simulated["search"]
    lengths = search["lengths"]
    assert lengths == sorted(lengths) and lengths[0] < lengths[-1]
    for gib, length in zip(search["budgets"], lengths):
        peaks = {int(key): value for key, value in search["peaks"][str(gib)].items()}
        usable = int(gib * 2**30)
        assert length % 1024 == 0 and peaks[length] <= usable
        assert peaks[length + 1024] > usable  # the next multiple of 1,024 was simulated and does not fit


def test_autocast_runs_matmuls_in_bf16_and_caches_one_weight_copy_per_region(simulated):
    autocast = simulated["autocast"]
    assert autocast["dtypes"] == ["torch.bfloat16", "torch.bfloat16"]
    assert autocast["inside"] - autocast["after"] == 1024 * 1024 * 2  # the cached copy, freed on exit


def test_cli_json_compare_and_plot(preloaded_python):
    plot = preloaded_python.directory / "lengths.png"
    result = preloaded_python.run(*_compare_and_plot(preloaded_python.directory))
    assert result.returncode == 0, result.stderr[-3000:]
    plan = json.loads(result.stdout)
    assert plan["sequence_length"] == 4096 and plan["precision"] == "32-true"
    assert plan["attention"] in ("varlen_by_document", "flash_attention_2")
    assert sum(plan["breakdown"].values()) == plan["peak_device_bytes"]
    assert plan["usable_bytes"] == int(plan["gpu_memory_bytes"] * 0.9) and plan["gpu_memory_bytes"] == int(0.05 * 2**30)
    assert plan["fits"] == (plan["peak_device_bytes"] <= plan["usable_bytes"])
    assert plan["phase"].startswith(("forward", "backward", "optimizer step"))
    assert plan["max_length"] % 1024 == 0 and plan["max_length"] > 0
    rows = {row["technique"]: row for row in plan["compare"]}
    assert list(rows)[:4] == ["plain", "+ checkpointing", "+ chunked loss", "+ tiled MLP"]
    assert rows["plain"]["peak_device_bytes"] > rows["+ checkpointing"]["peak_device_bytes"]
    assert rows["plain"]["max_length"] <= rows["+ offloaded checkpoints"]["max_length"]
    assert not rows["+ CPU-offloaded state"]["simulated"] and "FSDP2" in rows["+ CPU-offloaded state"]["note"]
    assert not rows["+ context parallel"]["simulated"]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 20_000
    _check_progress(result.stderr, plan, rows)


_PROGRESS = re.compile(r"\[(.+?)\] (.+) at ([\d,]+) tokens per row: ([\d,.]+) GiB, (fits|does not fit) \([\d.]+ s CPU\)")


def _check_progress(stderr: str, plan: dict, rows: dict) -> None:
    """One line per simulation, as it ends: what it was for, the techniques and length, the peak, the verdict; the
    longest lengths found (within 1%) are among them, as the lengths that confirm them."""
    found = [_PROGRESS.fullmatch(line) for line in stderr.splitlines() if line.startswith("[")]
    assert found and all(found), stderr[-3000:]
    simulations = [(match[1], match[2], int(match[3].replace(",", "")), match[5]) for match in found]
    assert [length for what, _, length, _ in simulations if what == "plan"] == [4096]  # the searches run at once
    assert len({(techniques, length) for _, techniques, length, _ in simulations}) == len(simulations)  # once each
    verdicts = {(techniques, length): verdict for _, techniques, length, verdict in simulations}
    for purpose, expected in [("longest length", plan), *((f"compare {name}", row) for name, row in rows.items())]:
        tried = {(techniques, length) for what, techniques, length, _ in simulations if what == purpose}
        if "max_length" not in expected or not tried:
            continue  # a row not simulated, or whose lengths were all simulated for an earlier purpose
        ((techniques, _), *_) = tried
        assert {what for what, _ in tried} == {techniques}, purpose  # one row, one set of techniques
        longest, too_long = expected["max_length"], expected["too_long"]
        assert too_long - longest <= max(1024, 0.01 * longest), (purpose, longest, too_long)
        assert verdicts[techniques, longest] == "fits" and verdicts[techniques, too_long] == "does not fit", purpose
        assert len(tried) <= 6, (purpose, tried)


def test_cli_plans_a_local_config_directory_and_says_what_to_add(preloaded_python, tmp_path: Path):
    """A model given as a directory with only a config.json (no weights) plans like the preset it was made from."""
    from lit_memtrain.models.presets import build_config

    overrides = {"vocab_size": 512, "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
                 "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}  # fmt: skip
    build_config("tiny-qwen3", overrides).save_pretrained(tmp_path)
    result = preloaded_python.run(
        "-m", "lit_memtrain.cli", "plan", "--config", "configs/quickstart.yaml", "--model.preset=null",
        f"--model.model={tmp_path}", "--data.batch_size=1", "--data.max_length=8192", "--model.loss_type=nll",
        "--trainer.callbacks=[]", "--gpu-memory=0.07", "--trainer.strategy=fsdp",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    text = result.stdout
    assert f"Model: {tmp_path}, 0.11M parameters" in text
    assert "DOES NOT FIT" in text and "To fit, add: gradient checkpointing" in text
    assert "trainer.strategy='fsdp' shards the model or the sequence" in text


def test_planning_a_fit_config_needs_neither_jsonargparse_nor_datasets():
    """What MemoryPlanCheck runs (--fit-config) on a GPU machine, which may lack jsonargparse, datasets and wandb.
    Then the command line's parser reads the SFT, DPO and GRPO configs without importing datasets (jsonargparse
    runs the TYPE_CHECKING block of a module whose annotations are strings: half a second of every plan).
    In a fresh ``python``: the preloaded one has imported them."""
    code = (
        "import sys, lit_memtrain.planner.command, lit_memtrain.planner.plan, lit_memtrain.planner.step, "
        "lit_memtrain.planner.report, lit_memtrain.planner.plot;"
        "from lit_memtrain.planner.fit_config import settings_from_config;"
        "settings_from_config({'model': {'preset': 'tiny-qwen3'}, 'trainer': {'strategy': "
        "{'class_path': 'lit_memtrain.strategies.ContextParallelStrategy', 'init_args': {'context_parallel_size': 2}}, "
        "'devices': 2}});"
        "print(sorted(m for m in ('datasets', 'wandb', 'jsonargparse') if m in sys.modules));"
        "from lit_memtrain.cli.plan import read_fit_config;"
        "[read_fit_config(['--config', f'configs/{name}.yaml']) for name in ('plan_qwen3_8b_1m', 'dpo', 'grpo')];"
        "print('datasets' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines() == ["[]", "False"]


BAD_INPUT = [
    (["--model.preset=null"], "The configuration has no model: set model.model"),
    (["--data.max_length=0"], "data.max_length must be at least 1 token, got 0."),
    (["--data.max_lenght=5"], "unknown option --data.max_lenght (did you mean '--data.max_length'?)"),
    (["--model.preset=null", "--model.model=/nonexistent/model"],
     "Cannot read the config of model='/nonexistent/model'"),
    (["--trainer.precision=transformer-engine"], "The planner cannot simulate trainer.precision='transformer-engine'"),
]  # fmt: skip

_BAD_INPUT = """
import contextlib, io, json, sys
from lit_memtrain.cli.plan import read_fit_config
from lit_memtrain.planner.command import main
results = []
for args in json.loads(sys.argv[1]):
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        status = main(["--config", "configs/quickstart.yaml", *args], read_fit_config)
    results.append([status, stderr.getvalue()])
print(json.dumps(results))
"""


def test_cli_refuses_an_unknown_preset_clearly(preloaded_python):
    result = preloaded_python.run("-m", "lit_memtrain.cli", "plan", "--config", "configs/quickstart.yaml",
                                       "--model.preset=qwen9", timeout=300)  # fmt: skip
    assert result.returncode == 2
    assert "lit-memtrain plan: error: Unknown model preset 'qwen9'. Known presets:" in result.stderr
    assert "Traceback" not in result.stderr


def test_bad_input_is_refused_clearly(preloaded_python):
    """What `lit-memtrain plan` runs (its main), for several bad inputs in one child process."""
    result = preloaded_python.run("-c", _BAD_INPUT, json.dumps([args for args, _ in BAD_INPUT]), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    for (args, message), (status, stderr) in zip(BAD_INPUT, json.loads(result.stdout.strip().splitlines()[-1])):
        assert status == 2, args
        assert message in stderr, (args, stderr)
        assert "Traceback" not in stderr


_LONGEST = re.compile(
    r"Longest max_length that fits: ([\d,]+) tokens per row \(([\d,]+), ([\d,]+) tokens or ([\d.]+)% longer, does not "
    r"fit; \d+ lengths simulated\)"
)


def test_the_longest_length_line_gives_the_real_gap_to_the_length_that_does_not_fit(preloaded_python):
    """At short lengths the search stops within 1,024 tokens, far more than 1%: the line says how far, not "1%"."""
    result = preloaded_python.run(
        "-m", "lit_memtrain.cli", "plan", *TINY, "--data.max_length=1024", "--gpu-memory=0.02", "--find-max-length"
    )  # fmt: skip
    found = _LONGEST.search(result.stdout)
    assert found, result.stdout[-3000:] + result.stderr[-3000:]
    longest, too_long, gap = (int(found[index].replace(",", "")) for index in (1, 2, 3))
    assert longest < 102_400 and too_long - longest == gap == 1024
    assert float(found[4]) == round(100 * gap / longest, 1) > 1
