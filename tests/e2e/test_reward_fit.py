"""Reward models end to end: ``lit-memtrain fit --config configs/reward.yaml`` trains a reward model through the CLI
and exports a sequence classifier (the ``slow`` test, about ten minutes of CPU: the whole config, training accuracy
above 0.9), the memory callbacks train it as without them, a checkpoint exports through ``lit-memtrain export`` (a
checkpoint of another kind is named), and ``lit-memtrain plan`` plans its step as the real step measures."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import datasets
import pytest
import torch
import wandb
from equivalence import TINY_MODEL_TERMS, assert_equal_up_to_rounding
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from memory_effects import TechniquesInEffect
from transformers import AutoModelForSequenceClassification

from lit_memtrain.callbacks import ActivationOffloading, GradientCheckpointing, TiledMLP
from lit_memtrain.cli import MemTrainCLI, main
from lit_memtrain.datamodules.embedded import make_preference, write_embedded_preferences
from lit_memtrain.datamodules.preference import PreferenceDataModule
from lit_memtrain.objectives.causal_lm import CausalLMModule
from lit_memtrain.objectives.reward import RewardModule
from lit_memtrain.objectives.reward_model_function import RewardModelFunction

ROOT = Path(__file__).resolve().parents[2]
REWARD_CONFIG = str(ROOT / "configs" / "reward.yaml")
SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "head_dim": 16}


def _held_out_accuracy(export: Path, pairs: list[dict]) -> float:
    """The share of ``pairs`` whose chosen answer the exported model scores above the rejected one."""
    score = RewardModelFunction(str(export), batch_size=32)
    prompts = [pair["prompt"] for pair in pairs]
    chosen = torch.tensor(score(prompts, [pair["chosen"] for pair in pairs]))
    rejected = torch.tensor(score(prompts, [pair["rejected"] for pair in pairs]))
    return float((chosen > rejected).float().mean())


@pytest.mark.slow
def test_the_reward_config_reaches_high_accuracy_through_the_cli(tmp_path, capsys, request):
    if "slow" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("the whole configs/reward.yaml run takes about ten minutes of CPU: run it with -m slow")
    export = tmp_path / "export"
    args = ["fit", "--config", REWARD_CONFIG, "--trainer.enable_progress_bar=false",
            f"--trainer.logger.init_args.save_dir={tmp_path}", f"--model.export_dir={export}"]  # fmt: skip
    try:
        main(args)
    finally:
        wandb.finish()  # the config logs to W&B (offline): later fits must not reuse this run
    out = capsys.readouterr().out
    first, last = map(float, re.search(r"reward accuracy: first ([\d.]+) -> last ([\d.]+)", out).groups())
    assert first < 0.8 and last > 0.9
    rng = random.Random(123)  # pairs the embedded training set was not drawn from: above chance, not memorised
    assert _held_out_accuracy(export, [make_preference(rng) for _ in range(200)]) > 0.6


def test_a_short_reward_fit_through_the_cli_learns_and_exports_a_sequence_classifier(tmp_path, capsys):
    data = write_embedded_preferences(tmp_path / "pairs.jsonl", num_examples=64)
    export = tmp_path / "export"
    args = [
        "fit", "--config", REWARD_CONFIG,
        "--trainer.max_steps=30", "--trainer.val_check_interval=30", "--trainer.limit_val_batches=1",
        "--trainer.enable_progress_bar=false", f"--trainer.logger.init_args.save_dir={tmp_path}",
        f"--model.config_overrides={json.dumps(SMALL)}", "--model.learning_rate=0.001", f"--model.export_dir={export}",
        f"--data.dataset={data}", "--data.batch_size=8", "--data.val_size=8",
    ]  # fmt: skip
    try:
        main(args)
    finally:
        wandb.finish()
    out = capsys.readouterr().out
    first, last = map(float, re.search(r"train loss: first ([\d.]+) -> last ([\d.]+) over 30 steps", out).groups())
    assert first == pytest.approx(0.6931, abs=0.05) and last < first - 0.1  # random head: rewards start near 0
    exported = AutoModelForSequenceClassification.from_pretrained(export)
    assert exported.config.num_labels == 1 and exported.config.num_hidden_layers == 2
    pairs = [json.loads(line) for line in data.read_text().splitlines()]
    assert _held_out_accuracy(export, pairs) > 0.5  # the training pairs: the export ranks them as training did
    assert list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))


def test_the_reward_config_parses_as_named_classes_with_the_tokenizer_linked():
    cli = MemTrainCLI(
        CausalLMModule, PreferenceDataModule, subclass_mode_model=True, subclass_mode_data=True,
        args=["--config", REWARD_CONFIG, "--model.center_rewards_coefficient=0.05"], run=False,
    )  # fmt: skip
    assert isinstance(cli.model, RewardModule) and isinstance(cli.datamodule, PreferenceDataModule)
    assert cli.model.hparams.center_rewards_coefficient == 0.05 and cli.model.recipe.task == "reward"
    assert cli.model.hparams.tokenizer == cli.datamodule.tokenizer_name == "lit-memtrain/embedded"
    assert cli.datamodule.long_pairs == "drop" and cli.datamodule.padding_free and cli.datamodule.pad_to_multiple_of


class _Record(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))


def _fit(callbacks: list[Callback], max_steps: int = 3, **trainer_options) -> tuple[list[float], RewardModule]:
    rng = random.Random(0)
    data = datasets.Dataset.from_list([make_preference(rng) for _ in range(12)])
    torch.manual_seed(0)
    module = RewardModule(preset="tiny-qwen3", tokenizer="lit-memtrain/embedded", learning_rate=0.01, warmup=0,
                          min_lr_ratio=1.0, config_overrides=SMALL)
    datamodule = PreferenceDataModule(dataset=data, batch_size=4, max_length=64, long_pairs="drop")
    record = _Record()
    trainer = Trainer(
        max_steps=max_steps, accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[*callbacks, record], enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        **trainer_options,
    )
    trainer.fit(module, datamodule=datamodule)
    return record.losses, module


def test_memory_callbacks_train_a_reward_model_as_without_them():
    losses, module = _fit([])
    weights = {n: p.detach().clone() for n, p in module.model.named_parameters()}
    offloading, in_effect = ActivationOffloading(offload_cpu_tensors_for_testing=True), TechniquesInEffect()
    other_losses, other = _fit([GradientCheckpointing(), TiledMLP(num_tiles=2), offloading, in_effect])
    in_effect.assert_in_effect(offloading=offloading)
    assert len(losses) == 3 and other_losses == pytest.approx(losses, rel=1e-5)
    for name, parameter in other.model.named_parameters():  # AdamW turns float noise in tiny gradients into lr steps
        weight = weights[name]
        torch.testing.assert_close(parameter, weight, rtol=1e-3, atol=1e-3 * float(weight.abs().max()))


def test_a_reward_checkpoint_exports_a_sequence_classifier_and_another_kind_is_named(tmp_path, capsys):
    _, module = _fit([ModelCheckpoint(tmp_path, "{step}", every_n_train_steps=3, save_top_k=-1)])
    main(["export", "--checkpoint", str(tmp_path / "step=3.ckpt"), "--output", str(tmp_path / "export")])
    assert "(RewardModule)" in capsys.readouterr().out
    exported = AutoModelForSequenceClassification.from_pretrained(tmp_path / "export").eval()
    rng = random.Random(7)
    datamodule = PreferenceDataModule(dataset=datasets.Dataset.from_list([make_preference(rng) for _ in range(4)]),
                                      batch_size=4, padding_free=False, long_pairs="drop")
    datamodule.setup("fit")
    batch = datamodule.collator()([datamodule.datasets["train"][i] for i in range(4)])
    module.model.eval()
    with torch.no_grad():
        theirs = exported(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, 0]
        assert_equal_up_to_rounding(theirs, module.sequence_rewards(batch), name="rewards", terms=TINY_MODEL_TERMS)

    class Plain(LightningModule):
        def __init__(self, width: int = 3) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.layer = torch.nn.Linear(width, 1)

    plain = tmp_path / "plain.ckpt"
    trainer = Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.strategy.connect(Plain())
    trainer.save_checkpoint(plain)
    with pytest.raises(SystemExit) as exit_info:
        main(["export", "--checkpoint", str(plain), "--output", str(tmp_path / "plain-export")])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert f"{str(plain)!r} is not a lit-memtrain checkpoint" in error and "hyper-parameters (width)" in error


_PLAN = """
import contextlib, io, json, sys
import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from lit_memtrain.planner.simulate import stand_in_device
device = stand_in_device()
import lit_memtrain.planner.step as step
from lit_memtrain.cli import main
from lit_memtrain.cli.plan import read_fit_config
from lit_memtrain.datamodules.preference_collate import PreferenceCollator
from lit_memtrain.objectives.step_tokens import STEP_WINDOW, StepWindow
from lit_memtrain.planner.plan import breakdown

out = io.StringIO()
with contextlib.redirect_stdout(out):
    main(["plan", "--config", sys.argv[1], "--json"])
results = {"stdout": out.getvalue()}


def collated_batch(settings, max_length, reference_mode=None):
    # What PreferenceDataModule gives the step: B pairs, chosen and rejected both max_length tokens long.
    pairs = [{"prompt_ids": [5] * 8, "chosen_ids": [6] * (max_length - 8), "rejected_ids": [7] * (max_length - 8)}
             for _ in range(settings.batch_size)]
    with unset_fake_temporarily():
        batch = PreferenceCollator(0, padding_free=settings.padding_free)(pairs)
    for name in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"):  # flash-attn's, read on the host
        batch.pop(name, None)
    batch[STEP_WINDOW] = StepWindow(settings.accumulate_grad_batches, settings.accumulate_grad_batches)
    return {k: torch.empty(v.shape, dtype=v.dtype, device=device) if torch.is_tensor(v) else v for k, v in batch.items()}


def real_training_step(module, optimizer, batch, callbacks, settings):
    module.log = lambda *args, **kwargs: None  # no Trainer to log to
    module.all_gather = lambda tensor: tensor  # one rank: the metrics' gather is the tensor itself
    for callback in callbacks:
        callback.on_train_batch_start(module.trainer, module, batch, 0)
    optimizer.zero_grad(set_to_none=True)  # as Lightning does between steps
    module.training_step(batch, 0).backward()
    optimizer.step()


settings = read_fit_config(["--config", sys.argv[1], "--data.batch_size=2", "--data.max_length=512"])
for name, hooks in (("planned", (step._batch, step._lightning_step)), ("real", (collated_batch, real_training_step))):
    planned = step._batch, step._lightning_step
    step._batch, step._lightning_step = hooks
    try:
        simulation = step.simulate_fit_step(settings)
    finally:
        step._batch, step._lightning_step = planned
    results[name] = {"peak": simulation.memory.device_peak, "phase": simulation.memory.phase,
                     "breakdown": breakdown(simulation)}
print(json.dumps(results))
"""
PLAN = ("-c", _PLAN, REWARD_CONFIG)


def start_early(python) -> None:
    """Queued when collection ends (tests/conftest.py): the plan runs on the other core while the fits run."""
    python.start(*PLAN)


def test_plan_simulates_the_reward_step(preloaded_python):
    result = preloaded_python.run(*PLAN)
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads(result.stdout.strip().splitlines()[-1])
    plan = json.loads(results["stdout"])
    assert plan["module"] == "RewardModule" and plan["model"] == "preset tiny-qwen3" and plan["fits"]
    assert plan["tokens_per_step"] == 2 * 32 * 64  # 32 pairs, chosen and rejected up to 64 tokens each
    assert plan["techniques"] == "gradient checkpointing"  # no LM head: the chunked loss does not apply
    assert not any("reference" in note for note in plan["notes"])
    # The real RewardModule.training_step on the batch PreferenceCollator makes: what the plan counts, plus the step's
    # metrics (five fp32 means) it keeps for the end-of-fit summary; position ids are an input there where transformers
    # makes the same tensor itself.
    planned, real = results["planned"], results["real"]
    assert real["peak"] - planned["peak"] == 5 * 4 and real["phase"] == planned["phase"]
    for kind in ("parameters", "gradients", "optimizer_state", "temporaries"):
        assert real["breakdown"][kind] == planned["breakdown"][kind], kind
