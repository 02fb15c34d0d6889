"""PlannerProcess, MemoryPlanCheck's child: forked from a process that has run no autograd and registered no device
(its imports done), a new interpreter otherwise, or when the forked child fails or never gets going, or in a process
forked after it (a launcher's rank); the same plan each way. Each case runs in a process of its own, as a script
would (``preloaded_python``)."""

from __future__ import annotations

import json

import pytest

FIT = {
    "model": {"class_path": "lit_memtrain.CausalLMModule",
              "init_args": {"preset": "tiny-qwen3", "loss_type": "nll",
                            "config_overrides": {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
                                                 "num_hidden_layers": 2}}},
    "data": {"class_path": "lit_memtrain.SFTDataModule", "init_args": {"max_length": 8192, "batch_size": 1}},
    "trainer": {"precision": "32-true"},
}  # fmt: skip

_SCRIPT = r"""
import json, os, subprocess, sys, threading
import torch
from lit_memtrain.callbacks.planner_process import PlannerProcess

new_interpreters = []

class Counted(subprocess.Popen):
    def __init__(self, args, *rest, **kwargs):
        new_interpreters.append(args)
        super().__init__(args, *rest, **kwargs)

subprocess.Popen = Counted
case, fit = sys.argv[1:]
if case == "after_a_backward":  # a notebook's second fit: the forked child cannot register its device
    x = torch.ones(2, requires_grad=True)
    (2 * x).sum().backward()
if case == "device_registered":  # the planner ran in this process before
    from lit_memtrain.planner.simulate import stand_in_device
    stand_in_device()
if case == "stuck":  # a forked child that never gets to wait for its arguments (a lock its fork copied, held)
    import types
    import lit_memtrain.callbacks.planner_process as planner_process
    planner_process._READY_S = 1.0
    planner_process.importlib = types.SimpleNamespace(import_module=lambda name: threading.Event().wait())
planner = PlannerProcess()
forked = planner.forked
arguments = ["--fit-config", fit, "--json", "--gpu-memory", "0.06"]
if case == "inherited":  # a rank forked by its launcher after the callback was made: it plans in a new interpreter
    rank = os.fork()
    if rank == 0:
        result = planner.run(arguments, timeout=300)
        with open(fit + ".rank", "w") as file:
            json.dump({"new_interpreters": len(new_interpreters), "plan": json.loads(result.stdout)}, file)
        os._exit(0)
    os.waitpid(rank, 0)
try:
    result = planner.run(arguments, timeout=0.001 if case == "timeout" else 300)
except subprocess.TimeoutExpired:
    result = None
try:
    os.waitpid(-1, os.WNOHANG)
    children_left = True
except ChildProcessError:
    children_left = False
print(json.dumps({
    "forked": forked, "new_interpreters": len(new_interpreters), "timed_out": result is None,
    "plan": json.loads(result.stdout) if result is not None and result.returncode == 0 else None,
    "stderr": "" if result is None else result.stderr[-2000:], "children_left": children_left,
    "rank": json.load(open(fit + ".rank")) if case == "inherited" else None,
}))
"""

CASES = ("clean", "after_a_backward", "device_registered", "inherited", "stuck", "timeout")


def _fit_file(python) -> str:
    path = python.directory / "planner_process_fit.json"
    path.write_text(json.dumps(FIT))
    return str(path)


def start_early(python) -> None:
    """Queued when collection ends (tests/conftest.py)."""
    for case in CASES:
        python.start("-c", _SCRIPT, case, _fit_file(python))


@pytest.fixture(scope="module")
def outcomes(preloaded_python) -> dict[str, dict]:
    results = {}
    for case in CASES:
        result = preloaded_python.run("-c", _SCRIPT, case, _fit_file(preloaded_python))
        assert result.returncode == 0, result.stderr[-3000:]
        results[case] = json.loads(result.stdout.strip().splitlines()[-1])
    return results


def test_a_clean_process_plans_in_a_forked_child_without_a_new_interpreter(outcomes):
    clean = outcomes["clean"]
    assert clean["forked"] and clean["new_interpreters"] == 0, clean["stderr"]
    plan = clean["plan"]
    assert plan["sequence_length"] == 8192 and plan["fits"] is False and plan["suggestion"]["fits"] is True


def test_where_the_fork_cannot_plan_a_new_interpreter_gives_the_same_plan(outcomes):
    clean = outcomes["clean"]["plan"]
    for case in ("after_a_backward", "stuck"):  # forked, then it failed or never got going: a new interpreter
        assert outcomes[case]["forked"] and outcomes[case]["new_interpreters"] == 1, case
    registered = outcomes["device_registered"]
    assert not registered["forked"] and registered["new_interpreters"] == 1  # not forked at all
    for case in ("after_a_backward", "stuck", "device_registered"):
        assert outcomes[case]["plan"] == clean, outcomes[case]["stderr"]
    assert not any(outcome["children_left"] for outcome in outcomes.values())


def test_a_process_forked_after_the_planner_plans_in_a_new_interpreter_and_leaves_the_child_alone(outcomes):
    """A rank of a forking launcher (``ddp_fork``) holds a copy of rank 0's planner: the child is not its own."""
    inherited = outcomes["inherited"]
    assert inherited["rank"]["new_interpreters"] == 1 and inherited["rank"]["plan"] == outcomes["clean"]["plan"]
    # The process that made it still plans in its forked child, which the rank left intact.
    assert inherited["forked"] and inherited["new_interpreters"] == 0
    assert inherited["plan"] == outcomes["clean"]["plan"], inherited["stderr"]


def test_a_plan_past_its_timeout_is_killed_and_raises(outcomes):
    timeout = outcomes["timeout"]
    assert timeout["timed_out"] and timeout["forked"] and not timeout["children_left"]
