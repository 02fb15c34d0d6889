"""`lit-memtrain plan` on a DPO configuration (configs/dpo.yaml): the simulated step is DPOModule's.

A tiny Qwen3 (hidden 64, vocabulary 512, tied embeddings, 2 layers) with P parameters in 24 tensors, fp32, B = 2
pairs of sequences of L = 2048 tokens (so 2B sequences per step), two accumulated micro-batches. Besides sizes
computed by hand, each plan is checked against the simulator's measurement of the real step: the same
simulation with the batch the real PreferenceCollator makes and DPOModule.training_step in place of the plan's
batch and loss. Everything runs in one child process (of ``preloaded_python``): the stand-in device must be
registered before a process's first backward.
"""

from __future__ import annotations

import json

import pytest

B, L, H, TENSORS = 2, 2048, 64, 24
FP32, LONG = 4, 8
TINY = (
    "--model.config_overrides={vocab_size: 512, num_hidden_layers: 2, hidden_size: 64, intermediate_size: 128, "
    "num_attention_heads: 4, num_key_value_heads: 2, head_dim: 16}"
)

_SIMULATIONS = """
import contextlib, io, json, sys
import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from lit_memtrain.planner.simulate import stand_in_device
device = stand_in_device()
import lit_memtrain.planner.step as step
from lit_memtrain.cli import main
from lit_memtrain.datamodules.preference_collate import PreferenceCollator
from lit_memtrain.objectives.dpo import DPOModule
from lit_memtrain.objectives.step_tokens import STEP_WINDOW, StepWindow
from lit_memtrain.cli.plan import read_fit_config
from lit_memtrain.planner.plan import breakdown

TINY = sys.argv[1]
CONFIG = ["--config", "configs/dpo.yaml", TINY, "--data.batch_size=2", "--data.max_length=2048",
          "--trainer.accumulate_grad_batches=2"]


class TrainsItsOwnWay(DPOModule):
    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx) * 2


def report(simulation):
    memory = simulation.memory
    return {"peak": memory.device_peak, "phase": memory.phase, "breakdown": breakdown(simulation),
            "parameters": simulation.parameters, "trainable": simulation.trainable_parameters}


def collated_batch(settings, max_length, reference_mode):
    # What PreferenceDataModule gives the step: B pairs, chosen and rejected both max_length tokens long.
    pairs = [{"prompt_ids": [5] * 8, "chosen_ids": [6] * (max_length - 8), "rejected_ids": [7] * (max_length - 8),
              "ref_chosen_logps": -1.0, "ref_rejected_logps": -2.0} for _ in range(settings.batch_size)]
    with unset_fake_temporarily():
        batch = PreferenceCollator(0, padding_free=settings.padding_free)(pairs)
    if reference_mode != "precomputed":
        del batch["ref_chosen_logps"], batch["ref_rejected_logps"]
    for name in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"):  # flash-attn's, read on the host
        batch.pop(name, None)
    accumulation = settings.accumulate_grad_batches  # a whole step, as the fit's training dataloader tags it
    batch[STEP_WINDOW] = StepWindow(accumulation, accumulation)
    return {k: torch.empty(v.shape, dtype=v.dtype, device=device) if torch.is_tensor(v) else v for k, v in batch.items()}


def real_training_step(module, optimizer, batch, callbacks, settings):
    module.log = lambda *args, **kwargs: None  # no Trainer to log to
    for callback in callbacks:
        callback.on_train_batch_start(module.trainer, module, batch, 0)
    module.training_step(batch, 0).backward()  # accumulating: Lightning does not zero the gradients here
    optimizer.step()


results = {}
variants = {
    "precomputed": [],
    "three_layers": ["--model.config_overrides.num_hidden_layers=3"],
    "padded": ["--data.padding_free=false"],
    "lora_base_reference": ["--model.lora={r: 4}", "--model.reference=adapter_disabled"],
}
for name, extra in variants.items():
    settings = read_fit_config(CONFIG + extra)
    results[name] = report(step.simulate_fit_step(settings))
    planned = step._batch, step._lightning_step
    step._batch, step._lightning_step = collated_batch, real_training_step
    try:
        results[name + "_real"] = report(step.simulate_fit_step(settings))
    finally:
        step._batch, step._lightning_step = planned

def cli(*args):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(["plan", *args])
            status = 0
        except SystemExit as exit:
            status = exit.code
    return {"status": status, "stdout": out.getvalue(), "stderr": err.getvalue()}

results["cli_json"] = cli("--config", "configs/dpo.yaml", "--json")
results["cli_text"] = cli(*CONFIG, "--gpu-memory=0.04")
results["refused"] = [cli("--config", "configs/dpo.yaml", *args) for args in json.loads(sys.argv[2])]
print(json.dumps(results))
"""

REFUSED = [
    (["--context-parallel-size=2", "--trainer.devices=2"], "DPOModule does not support context parallelism"),
    (["--model.class_path=__main__.TrainsItsOwnWay"],
     "model.class_path is '__main__.TrainsItsOwnWay', which overrides training_step of DPOModule"),
    (["--data.class_path=lightning.pytorch.demos.boring_classes.BoringDataModule"],
     "DPOModule is planned on the batches of lit_memtrain.datamodules.preference.PreferenceDataModule"),
    (["--data.class_path=lit_memtrain.datamodules.SFTDataModule"],
     "but data.class_path is 'lit_memtrain.datamodules.SFTDataModule'. Plan with --data.class_path="),
    (["--model.reference=adapter_disabled"], "reference='adapter_disabled' takes the reference from the base model"),
]  # fmt: skip


SIMULATIONS = ("-c", _SIMULATIONS, TINY, json.dumps([args for args, _ in REFUSED]))


def start_early(python) -> None:
    """Queued when collection ends (tests/conftest.py)."""
    python.start(*SIMULATIONS)


@pytest.fixture(scope="module")
def simulated(preloaded_python) -> dict:
    result = preloaded_python.run(*SIMULATIONS)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_fixed_memory_is_parameters_gradients_and_adamw_state_exactly(simulated):
    report = simulated["precomputed"]
    parameters, kinds = report["parameters"], report["breakdown"]
    assert kinds["parameters"] == kinds["gradients"] == FP32 * parameters
    assert kinds["optimizer_state"] == 2 * FP32 * parameters + 4 * TENSORS
    assert sum(kinds.values()) == report["peak"]


def test_each_checkpointed_layer_keeps_its_input_for_both_sequences_of_each_pair(simulated):
    two, three = simulated["precomputed"], simulated["three_layers"]
    assert (two["phase"], three["phase"]) == ("backward, decoder layer 1", "backward, decoder layer 2")
    assert three["breakdown"]["activations"] - two["breakdown"]["activations"] == 2 * B * L * H * FP32


@pytest.mark.parametrize("name", ["precomputed", "three_layers", "padded", "lora_base_reference"])
def test_the_plan_is_the_measured_real_dpo_step(simulated, name):
    """The real step's batch has what the plan leaves out as negligible: position ids as an input where
    transformers makes the same tensor itself (padding-free), the attention mask of padded rows; and
    DPOModule.training_step keeps the micro-batch's reward margin (one fp32 scalar) through the backward."""
    planned, real = simulated[name], simulated[name + "_real"]
    attention_mask = 2 * B * L * LONG if name == "padded" else 0
    assert real["peak"] - planned["peak"] == attention_mask + FP32
    assert real["phase"] == planned["phase"]
    for kind in ("parameters", "gradients", "optimizer_state", "temporaries"):
        assert real["breakdown"][kind] == planned["breakdown"][kind], kind


def test_a_lora_run_trains_the_adapter_and_takes_the_reference_from_the_base_model(simulated):
    lora, full = simulated["lora_base_reference"], simulated["precomputed"]
    assert lora["trainable"] < lora["parameters"] / 10
    assert lora["breakdown"]["gradients"] == FP32 * lora["trainable"]
    assert lora["peak"] < full["peak"]


def test_cli_plans_the_shipped_dpo_config(simulated):
    result = simulated["cli_json"]
    assert result["status"] == 0, result["stderr"][-3000:]
    plan = json.loads(result["stdout"])
    assert plan["module"] == "DPOModule" and plan["model"] == "preset tiny-qwen3"
    assert plan["tokens_per_step"] == 2 * 16 * 64  # 16 pairs, chosen and rejected up to 64 tokens each
    assert plan["techniques"] == "gradient checkpointing, chunked loss" and plan["fits"]
    assert sum(plan["breakdown"].values()) == plan["peak_device_bytes"]
    assert any("reference='precomputed'" in note for note in plan["notes"])

    text = simulated["cli_text"]
    assert text["status"] == 0, text["stderr"][-3000:]
    assert "Step: DPO, 2 pair(s) (chosen and rejected sequences): 4 x 2,048 tokens in one padding-free row" in text["stdout"]
    assert "DOES NOT FIT" in text["stdout"]
    assert "ContextParallelStrategy" not in text["stdout"]  # DPOModule refuses context parallelism: not suggested


def test_what_cannot_be_planned_is_refused_clearly(simulated):
    for (args, message), result in zip(REFUSED, simulated["refused"]):
        assert result["status"] == 2, args
        assert message in result["stderr"], (args, result["stderr"])
        assert "Traceback" not in result["stderr"]
