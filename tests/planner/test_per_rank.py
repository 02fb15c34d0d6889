"""One rank of an FSDP2 or context-parallel step (`lit-memtrain plan` with FSDP2Strategy, ContextParallelStrategy
or --context-parallel-size), against hand-computed sizes.

A tiny Qwen3 (hidden 64, 4 query and 2 key/value heads of 16, vocabulary 512, tied embeddings), fp32, one row of
L = 8192 tokens, checkpointing, on 2 ranks: data parallel 2 (each rank its own row) or context parallel 2 (one
row split over both). The model is sharded over both ranks either way: each holds half of every parameter, its
gradient and AdamW state. Simulations run in one child process of ``preloaded_python`` (the stand-in device must be
registered before the process's first backward).
"""

from __future__ import annotations

import json

import pytest

from lit_memtrain.planner.fit_config import strategy_spec

L, H, FP32 = 8192, 64, 4
KV_HEADS, HEAD_DIM = 2, 16
ROOT = 512 * 64 + 64  # the root unit's parameters: the tied embedding and the final norm

_SIMULATIONS = """
import json
from lit_memtrain.planner.simulate import stand_in_device
stand_in_device()
from lit_memtrain.planner.plan import Budget, Planner, breakdown
from lit_memtrain.planner.settings import CallbackSpec, PlanSettings, StrategySpec

def settings(layers=2, cp=1, method="ulysses", offload=False, cpu_offload=False, norm=False):
    strategy = StrategySpec("ContextParallelStrategy", 2, "context_parallel" if cp > 1 else "fsdp2",
                            cpu_offload=cpu_offload, context_parallel_size=cp, context_parallel_method=method)
    return PlanSettings(
        module={"preset": "tiny-qwen3", "config_overrides": {"vocab_size": 512, "num_hidden_layers": layers}},
        callbacks=(CallbackSpec("lit_memtrain.callbacks.GradientCheckpointing", {"offload": offload}),)
        + ((CallbackSpec("lit_memtrain.callbacks.ChunkedRMSNorm", {"chunk_elements": 64 * 512}),) if norm else ()),
        max_length=8192, strategy=strategy,
    )

def report(planner_settings):
    step = Planner(planner_settings, Budget(2**40), progress=lambda line: None).simulate()
    memory = step.memory
    return {"peak": memory.device_peak, "fixed": memory.fixed, "phase": memory.phase, "breakdown": breakdown(step),
            "host": memory.host_at_peak, "parameters": step.parameters, "notes": step.notes}

print(json.dumps({name: report(value) for name, value in {
    "dp2": settings(), "dp2_3": settings(3), "cp2": settings(cp=2), "cp2_3": settings(3, cp=2),
    "cp2_offloaded": settings(3, cp=2, offload=True), "ring2": settings(cp=2, method="ring"),
    "cp2_cpu_offload": settings(cp=2, cpu_offload=True), "cp2_norm": settings(cp=2, norm=True),
}.items()}))
"""


SIMULATIONS = ("-c", _SIMULATIONS)


def start_early(python) -> None:
    """Queued when collection ends (tests/conftest.py)."""
    python.start(*SIMULATIONS)


@pytest.fixture(scope="module")
def simulated(preloaded_python) -> dict:
    result = preloaded_python.run(*SIMULATIONS)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def _gathered(report: dict) -> int:
    """The root and one decoder layer gathered in fp32 (no mixed precision): what a rank computes with."""
    layer = (report["parameters"] - ROOT) // 2
    return FP32 * (ROOT + layer)


@pytest.mark.parametrize("name", ["dp2", "cp2"])
def test_each_rank_holds_half_of_the_parameters_gradients_and_adamw_state(simulated, name):
    report = simulated[name]
    parameters, kinds = report["parameters"], report["breakdown"]
    assert report["fixed"] == (FP32 + FP32 + 2 * FP32) * parameters // 2
    assert kinds["parameters"] == FP32 * parameters // 2 + _gathered(report)  # at a backward peak
    assert kinds["optimizer_state"] == 2 * FP32 * parameters // 2  # AdamW's step counters are on the host
    assert sum(kinds.values()) == report["peak"]


def test_a_context_parallel_rank_keeps_a_checkpointed_layer_input_of_its_shard(simulated):
    """One more layer adds its saved input: L x H on a data-parallel rank, L / 2 x H on a context-parallel one."""
    assert simulated["dp2_3"]["breakdown"]["activations"] - simulated["dp2"]["breakdown"]["activations"] == L * H * FP32
    assert simulated["cp2_3"]["breakdown"]["activations"] - simulated["cp2"]["breakdown"]["activations"] == (
        L // 2 * H * FP32
    )
    assert simulated["cp2_offloaded"]["host"]["activations"] == 3 * (L // 2) * H * FP32
    assert "this rank holds 4,096 of 8,192 tokens per row" in simulated["cp2"]["notes"][0]


def test_context_parallel_halves_what_grows_with_the_sequence(simulated):
    def sequence_part(report: dict) -> int:
        return sum(report["breakdown"][kind] for kind in ("activations", "temporaries", "other"))

    ratio = sequence_part(simulated["cp2"]) / sequence_part(simulated["dp2"])
    assert 0.45 < ratio < 0.6  # 1/2, plus Ulysses' exchange buffers


def test_ring_holds_the_gathered_keys_and_values_of_the_row(simulated):
    ring, ulysses = simulated["ring2"], simulated["cp2"]
    assert ring["peak"] - ulysses["peak"] >= 2 * L * KV_HEADS * HEAD_DIM * FP32
    assert "all-gathers the whole row's keys and values" in ring["notes"][0]


def test_cpu_offload_moves_the_shards_to_the_host(simulated):
    report = simulated["cp2_cpu_offload"]
    parameters = report["parameters"]
    assert report["fixed"] == 0
    assert report["breakdown"]["parameters"] == _gathered(report)
    assert report["host"]["parameters"] == report["host"]["gradients"] == FP32 * parameters // 2
    assert report["host"]["optimizer_state"] >= 2 * FP32 * parameters // 2
    assert report["peak"] < simulated["cp2"]["peak"]


def test_strategy_init_args_are_read_without_the_class():
    spec = strategy_spec(
        {"class_path": "lit_memtrain.strategies.ContextParallelStrategy",
         "init_args": {"context_parallel_size": 4, "method": "ring", "cpu_offload": True, "mixed_precision": "bf16"}},
        8, None,
    )  # fmt: skip
    assert (spec.kind, spec.world_size, spec.context_parallel_size, spec.context_parallel_method) == (
        "context_parallel", 8, 4, "ring",
    )  # fmt: skip
    assert spec.cpu_offload and spec.mixed_precision == "bf16" and spec.ring_backend == "all_gather"
    fsdp2 = strategy_spec({"class_path": "lit_memtrain.strategies.FSDP2Strategy", "init_args": {}}, 2, 2)
    assert (fsdp2.kind, fsdp2.world_size, fsdp2.cpu_offload) == ("fsdp2", 4, False)


TINY = [
    "--config", "configs/quickstart.yaml", "--model.preset=tiny-qwen3",
    "--model.config_overrides={vocab_size: 512, num_hidden_layers: 2, hidden_size: 64, intermediate_size: 128, "
    "num_attention_heads: 4, num_key_value_heads: 2, head_dim: 16}",
    "--data.batch_size=1", "--trainer.strategy=lit_memtrain.strategies.FSDP2Strategy",
]  # fmt: skip


def test_cli_plans_one_rank_of_a_context_parallel_fsdp2_run(preloaded_python):
    result = preloaded_python.run(
        "-m", "lit_memtrain.cli", "plan", *TINY, "--trainer.devices=4", "--trainer.strategy.cpu_offload=true",
        "--context-parallel-size=2", "--data.max_length=4096", "--json", timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    plan = json.loads(result.stdout)
    assert plan["strategy"] == {
        "name": "FSDP2Strategy", "world_size": 4, "simulated": True, "kind": "context_parallel", "cpu_offload": True,
        "context_parallel_size": 2, "context_parallel_method": "ulysses",
    }  # fmt: skip
    assert plan["techniques"].endswith("CPU-offloaded state, context parallel over 2 ranks")
    assert plan["breakdown"]["gradients"] == plan["breakdown"]["optimizer_state"] == 0
    assert plan["host_breakdown"]["optimizer_state"] >= 2 * plan["host_breakdown"]["parameters"]
    assert "this rank holds 2,048 of 4,096 tokens per row" in " ".join(plan["notes"])


def test_compare_adds_the_strategy_rows_when_the_strategy_has_them():
    from lit_memtrain.planner.settings import PlanSettings, StrategySpec
    from lit_memtrain.planner.techniques import comparison_rows

    def rows(strategy: StrategySpec) -> dict:
        plan = PlanSettings(module={"preset": "tiny-qwen3"}, strategy=strategy)
        return {name: (techniques, note) for name, techniques, note in comparison_rows(plan)}

    single = rows(StrategySpec())
    assert single["+ CPU-offloaded state"][0] is None and "FSDP2Strategy" in single["+ CPU-offloaded state"][1]
    assert single["+ context parallel"][0] is None
    sharded = rows(StrategySpec("FSDP2Strategy", 8, "fsdp2"))
    assert sharded["+ CPU-offloaded state"][0].cpu_offload and sharded["+ context parallel"][0] is None
    split = rows(StrategySpec("ContextParallelStrategy", 8, "context_parallel", context_parallel_size=4))
    context, note = split["+ context parallel"]
    assert (context.cpu_offload, context.context_parallel_size, note) == (True, 4, "4 ranks per sequence, ulysses")
    assert split["+ offloaded checkpoints"][0].context_parallel_size == 1


BAD_INPUT = [
    (["--trainer.devices=4", "--context-parallel-size=3"],
     "context_parallel_size=3 does not divide the world size 4 (trainer.devices x trainer.num_nodes)"),
    (["--trainer.devices=6", "--context-parallel-size=3"],
     "method='ulysses' with context_parallel_size=3 needs num_attention_heads (4) divisible by 3"),
    (["--trainer.devices=2", "--context-parallel-size=0"], "context_parallel_size must be a positive int, got 0."),
    (["--trainer.strategy=fsdp", "--context-parallel-size=2"],
     "--context-parallel-size plans lit_memtrain.strategies.ContextParallelStrategy, but trainer.strategy is 'fsdp'"),
]  # fmt: skip

_BAD_INPUT = """
import contextlib, io, json, sys
from lit_memtrain.cli.plan import read_fit_config
from lit_memtrain.planner.command import main
results = []
for args in json.loads(sys.argv[1]):
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        status = main([*json.loads(sys.argv[2]), "--data.max_length=1024", *args], read_fit_config)
    results.append([status, stderr.getvalue()])
print(json.dumps(results))
"""


def test_bad_context_parallel_sizes_are_refused_clearly(preloaded_python):
    arguments = json.dumps([args for args, _ in BAD_INPUT])
    result = preloaded_python.run("-c", _BAD_INPUT, arguments, json.dumps(TINY), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    for (args, message), (status, stderr) in zip(BAD_INPUT, json.loads(result.stdout.strip().splitlines()[-1])):
        assert status == 2, (args, stderr)
        assert message in stderr, (args, stderr)
        assert "Traceback" not in stderr


def test_a_live_fsdp2_strategy_is_planned_with_its_options():
    """What MemoryPlanCheck reads from the Trainer's strategy (its description of the fit's config)."""
    from lit_memtrain.callbacks.live_fit import strategy_config
    from lit_memtrain.strategies import FSDP2Strategy
    from lit_memtrain.parallel.fsdp import mixed_precision_policy

    live = FSDP2Strategy(mixed_precision="bf16", cpu_offload=True, reshard_after_forward=False)
    spec = strategy_spec(strategy_config(live), 2, 1)
    assert (spec.kind, spec.world_size, spec.cpu_offload, spec.reshard_after_forward) == ("fsdp2", 2, True, False)
    assert spec.mixed_precision == {"param_dtype": "bfloat16", "reduce_dtype": "float32"}
    assert mixed_precision_policy(spec.mixed_precision) == live.mp_policy


def test_a_live_context_parallel_strategy_is_planned_per_rank():
    from lit_memtrain.callbacks.live_fit import strategy_config
    from lit_memtrain.strategies import ContextParallelStrategy

    live = ContextParallelStrategy(context_parallel_size=2, method="ring", cpu_offload=True)
    spec = strategy_spec(strategy_config(live), 4, 1)
    assert (spec.kind, spec.world_size, spec.context_parallel_size) == ("context_parallel", 4, 2)
    assert (spec.context_parallel_method, spec.ring_backend, spec.cpu_offload) == ("ring", "all_gather", True)


def test_chunked_rms_norms_lower_the_peak_of_the_recomputed_layer(simulated):
    """The norms' backward no longer makes fp32 tensors of the whole shard (L / 2 x H each): at least three fewer
    at the peak, in the temporaries only."""
    plain, chunked = simulated["cp2"], simulated["cp2_norm"]
    assert plain["peak"] - chunked["peak"] >= 3 * (L // 2) * H * FP32
    assert plain["peak"] - chunked["peak"] == plain["breakdown"]["temporaries"] - chunked["breakdown"]["temporaries"]
