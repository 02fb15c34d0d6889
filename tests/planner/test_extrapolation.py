"""A plan extrapolated from a few decoder layers against the whole-model simulation of the same step.

`simulate_fit_step` simulates a model whose layers are identical with 2a + 1 and 2a + 2 of them and extrapolates
(lit_memtrain/planner/layers.py); `whole=True` simulates every layer, as the planner did before. The figures must be
the same, to the byte (the issue asks for 0.5%; the argument is exact): Qwen3-4B on one device; Llama-3.1-8B under
FSDP2 with context parallelism, CPU-offloaded state and offloaded checkpoints; a (small) Qwen3-MoE under FSDP2 with
every technique; activation offloading, which anchors two layers at each end. A model whose layers differ (a dense
layer among experts) or a technique the planner does not know must be simulated whole, with the reason in the notes. Short rows (1,024 to 2,048 tokens): what is exact does not depend on
the length, and the whole-model simulations of 8B models stay a few seconds each. Everything runs in one child
process of ``preloaded_python``, started early, in the background.
"""

from __future__ import annotations

import json

import pytest

_SIMULATIONS = r"""
import json, sys, time, warnings
warnings.filterwarnings("ignore")
from lit_memtrain.planner.simulate import stand_in_device
stand_in_device()
from lit_memtrain.planner.plan import breakdown
from lit_memtrain.planner.settings import CallbackSpec, PlanSettings, StrategySpec
from lit_memtrain.callbacks import GradientCheckpointing
from lit_memtrain.planner.step import simulate_fit_step


class CountingCheckpointing(GradientCheckpointing):  # under another name: the planner cannot know what it does
    pass


def callback(name, **init_args):
    return CallbackSpec(f"lit_memtrain.callbacks.{name}", init_args)

OFFLOADED = (callback("GradientCheckpointing", offload=True),)
EVERY = (*OFFLOADED, callback("TiledMLP"), callback("ChunkedRMSNorm"))
MOE = {"model_type": "qwen3_moe", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
       "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2, "num_hidden_layers": 8,
       "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
TINY = {"vocab_size": 512, "num_hidden_layers": 12}
CASES = {
    "qwen3-4b": dict(module={"preset": "qwen3-4b", "dtype": "bfloat16", "loss_type": "chunked"},
                     callbacks=(callback("GradientCheckpointing"),), precision="bf16-mixed", max_length=1024),
    "llama-3.1-8b fsdp2 context parallel": dict(
        module={"preset": "llama-3.1-8b", "loss_type": "chunked"}, callbacks=OFFLOADED, precision="32-true",
        max_length=2048, strategy=StrategySpec("ContextParallelStrategy", 4, "context_parallel", mixed_precision="bf16",
                                               cpu_offload=True, context_parallel_size=2)),
    "qwen3-moe fsdp2": dict(module={"config": MOE, "dtype": "bfloat16", "loss_type": "chunked"}, callbacks=EVERY,
                            precision="bf16-true", max_length=1024, strategy=StrategySpec("FSDP2Strategy", 4, "fsdp2")),
    "activation offloading": dict(  # two layers anchored at each end: the two most recent inputs stay on the device
        module={"preset": "tiny-qwen3", "config_overrides": TINY},
        callbacks=(callback("GradientCheckpointing"), callback("ActivationOffloading", max_fwd_stash_size=2)),
        max_length=1024),
    "dense layer first": dict(module={"config": {**MOE, "mlp_only_layers": [0]}, "dtype": "bfloat16"},
                              callbacks=(callback("GradientCheckpointing"),), precision="bf16-true", max_length=1024),
    "unknown technique": dict(module={"preset": "tiny-qwen3", "config_overrides": TINY},
                              callbacks=(CallbackSpec("__main__.CountingCheckpointing", {}),), max_length=512),
}

def figures(step, seconds):
    memory = step.memory
    return {"peak": memory.device_peak, "host_peak": memory.host_peak, "phase": memory.phase,
            "breakdown": breakdown(step), "device_at_peak": memory.device_at_peak, "host_at_peak": memory.host_at_peak,
            "fixed": memory.fixed, "parameters": step.parameters, "trainable": step.trainable_parameters,
            "layers": step.layers, "notes": list(step.notes), "seconds": seconds}

results = {}
for name, arguments in CASES.items():
    if len(sys.argv) > 1 and name not in sys.argv[1:]:
        continue
    settings = PlanSettings(padding_free=True, **arguments)
    results[name] = {}
    for whole in (False, True):
        start = time.process_time()
        step = simulate_fit_step(settings, whole=whole)
        results[name]["whole" if whole else "extrapolated"] = figures(step, time.process_time() - start)
# The emulated autocast with a dtype given by position (Qwen3-MoE's router: softmax(logits, dtype=float) reaches
# aten as softmax(x, dim, dtype)): the given dtype, and fp32 when it is None, as CUDA's autocast does.
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
with FakeTensorMode(allow_non_fake_inputs=True), torch.autocast("gpu", dtype=torch.bfloat16):
    logits = torch.empty(4, 8, dtype=torch.bfloat16, device=stand_in_device())
    results["softmax dtypes"] = [str(torch.ops.aten.softmax.int(logits, -1, dtype).dtype)
                                 for dtype in (None, torch.float32, torch.bfloat16)]
print(json.dumps(results))
"""

SIMULATIONS = ("-c", _SIMULATIONS)
FIGURES = ("peak", "host_peak", "phase", "breakdown", "device_at_peak", "host_at_peak", "fixed", "parameters",
           "trainable", "layers")  # fmt: skip


def start_early(python) -> None:
    """Queued when collection ends (tests/conftest.py)."""
    python.start(*SIMULATIONS)


@pytest.fixture(scope="module")
def simulated(preloaded_python) -> dict:
    result = preloaded_python.run(*SIMULATIONS)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "name", ["qwen3-4b", "llama-3.1-8b fsdp2 context parallel", "qwen3-moe fsdp2", "activation offloading"]
)
def test_the_extrapolated_plan_is_the_whole_model_simulation(simulated, name):
    extrapolated, whole = simulated[name]["extrapolated"], simulated[name]["whole"]
    assert {key: extrapolated[key] for key in FIGURES} == {key: whole[key] for key in FIGURES}
    assert extrapolated["notes"] == whole["notes"]
    assert not any("Simulated with all" in note for note in extrapolated["notes"])
    assert whole["peak"] > whole["fixed"] >= 0 and whole["peak"] > 0


def test_the_peak_phase_names_the_layer_of_the_whole_model(simulated):
    """The peak of the 36-layer Qwen3-4B is in a layer the smaller simulations do not have."""
    phase = simulated["qwen3-4b"]["extrapolated"]["phase"]
    assert phase == simulated["qwen3-4b"]["whole"]["phase"]
    assert simulated["qwen3-4b"]["whole"]["layers"] == 36


def test_extrapolating_is_faster_for_a_large_model(simulated):
    for name in ("qwen3-4b", "llama-3.1-8b fsdp2 context parallel"):
        assert simulated[name]["extrapolated"]["seconds"] < simulated[name]["whole"]["seconds"] / 2, name


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("dense layer first", "the config's mlp_only_layers=[0] makes some layers different"),
        ("unknown technique", "the technique callback CountingCheckpointing is not one the planner knows to treat "
                              "every decoder layer alike"),  # fmt: skip
    ],
)
def test_layers_the_planner_cannot_show_alike_are_simulated_whole_and_the_notes_say_why(simulated, name, reason):
    """The plan is the figures of ``whole=True`` (which simulates every layer without asking whether it must),
    plus the note."""
    plan, whole = simulated[name]["extrapolated"], simulated[name]["whole"]
    assert {key: plan[key] for key in FIGURES} == {key: whole[key] for key in FIGURES}
    layers = whole["layers"]
    assert layers in (8, 12) and whole["peak"] > whole["fixed"] > 0
    note = f"Simulated with all {layers} decoder layers (slower): {reason}."
    assert plan["notes"] == [*whole["notes"], note]


def test_layers_that_differ_are_found_on_the_model():
    """Sliding-window layers among full-attention ones, and a dense MLP among experts, on the meta device."""
    import torch
    from transformers import AutoModelForCausalLM

    from lit_memtrain.models.presets import build_config
    from lit_memtrain.planner.layers import layers_differ, with_layer_count

    small = {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2,
             "num_key_value_heads": 1, "head_dim": 16, "num_hidden_layers": 4}  # fmt: skip
    windows = build_config({"model_type": "qwen2", **small, "use_sliding_window": True, "sliding_window": 64,
                            "max_window_layers": 2})  # fmt: skip
    experts = build_config({"model_type": "qwen3_moe", **small, "moe_intermediate_size": 16, "num_experts": 4,
                            "num_experts_per_tok": 2, "decoder_sparse_step": 2})  # fmt: skip
    alike = build_config("tiny-qwen3", {"num_hidden_layers": 4})
    with torch.device("meta"):
        models = {name: AutoModelForCausalLM.from_config(config) for name, config in
                  {"windows": windows, "experts": experts, "alike": alike}.items()}  # fmt: skip
    assert layers_differ(models["windows"]).startswith("the config's layer_types differs between layers")
    assert layers_differ(models["experts"]) == "the config's decoder_sparse_step=2 makes some layers different"
    assert layers_differ(models["alike"]) is None
    assert with_layer_count(windows, 3).layer_types == windows.layer_types[:3]


def test_two_layer_classes_of_one_short_name_are_named_in_full():
    """A LoRA adapter on the top layers only wraps their projections in peft's ``Linear``: the note names both
    modules' classes, not "a Linear, a Linear"."""
    import torch
    from transformers import AutoModelForCausalLM

    from lit_memtrain.models.presets import build_config
    from lit_memtrain.planner.layers import layers_differ

    Linear = type("Linear", (torch.nn.Linear,), {"__module__": "adapters.lora"})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(build_config("tiny-qwen3", {"num_hidden_layers": 3}))
        attention = model.model.layers[2].self_attn
        attention.q_proj = Linear(attention.q_proj.in_features, attention.q_proj.out_features, bias=False)
    assert layers_differ(model) == (
        "decoder layer 2 differs from decoder layer 0 (self_attn.q_proj is a torch.nn.modules.linear.Linear, "
        "self_attn.q_proj a adapters.lora.Linear)"
    )


def test_the_emulated_autocast_reads_a_dtype_given_by_position(simulated):
    assert simulated["softmax dtypes"] == ["torch.float32", "torch.float32", "torch.bfloat16"]
