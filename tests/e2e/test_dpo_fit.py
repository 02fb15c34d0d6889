"""DPO end to end: ``lit-memtrain fit --config configs/dpo.yaml`` grows the reward margin, and the memory
callbacks give the same training as without them."""

from __future__ import annotations

import re
from pathlib import Path

import datasets
import pytest
import torch
import wandb
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from memory_effects import TechniquesInEffect
from transformers import AutoModelForCausalLM

from lit_memtrain.callbacks import ActivationOffloading, GradientCheckpointing, TiledMLP
from lit_memtrain.cli import MemTrainCLI, main, names_model_class
from lit_memtrain.datamodules.embedded import make_preference, write_embedded_preferences
from lit_memtrain.datamodules.preference import PreferenceDataModule
from lit_memtrain.objectives.dpo import DPOModule
from lit_memtrain.objectives.causal_lm import CausalLMModule

ROOT = Path(__file__).resolve().parents[2]
DPO_CONFIG = str(ROOT / "configs" / "dpo.yaml")
SMALL = "{hidden_size: 64, intermediate_size: 128, num_hidden_layers: 2, head_dim: 16}"


def test_the_dpo_config_grows_the_reward_margin_through_the_cli(tmp_path, capsys):
    data = write_embedded_preferences(tmp_path / "pairs.jsonl", num_examples=40)
    export = tmp_path / "export"
    args = [
        "fit", "--config", DPO_CONFIG,
        "--trainer.max_steps=12", "--trainer.val_check_interval=12", "--trainer.limit_val_batches=1",
        "--trainer.enable_progress_bar=false", f"--trainer.logger.init_args.save_dir={tmp_path}",
        f"--model.config_overrides={SMALL}", "--model.learning_rate=0.01", f"--model.export_dir={export}",
        f"--data.dataset={data}", "--data.batch_size=8", "--data.val_size=8",
    ]
    try:
        main(args)
    finally:
        wandb.finish()  # the config logs to W&B (offline): later fits must not reuse this run
    out = capsys.readouterr().out
    first, last = map(float, re.search(r"train loss: first ([\d.]+) -> last ([\d.]+) over 12 steps", out).groups())
    start, end = map(float, re.search(r"reward margin: first (-?[\d.]+) -> last (-?[\d.]+)", out).groups())
    assert first == pytest.approx(0.6931, abs=1e-4) and start == 0  # the policy starts as its own reference
    assert last < first - 0.1 and end > 0.2
    assert AutoModelForCausalLM.from_pretrained(export).config.num_hidden_layers == 2
    assert list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))  # rewards/* went to W&B (offline)


def test_the_dpo_config_parses_as_named_classes_with_the_tokenizer_linked():
    assert names_model_class(["fit", "--config", DPO_CONFIG]) and not names_model_class(["fit", "--model.beta=1"])
    cli = MemTrainCLI(
        CausalLMModule, PreferenceDataModule, subclass_mode_model=True, subclass_mode_data=True,
        args=["--config", DPO_CONFIG, "--model.beta=0.3", "--optimizer=torch.optim.SGD", "--optimizer.lr=0.1"], run=False,
    )
    assert isinstance(cli.model, DPOModule) and isinstance(cli.datamodule, PreferenceDataModule)
    assert cli.model.hparams.beta == 0.3 and cli.model.reference_mode == "precomputed"
    assert cli.model.hparams.tokenizer == cli.datamodule.tokenizer_name == "lit-memtrain/embedded"
    assert cli.model.hparams.optimizer == {"class_path": "torch.optim.SGD", "init_args": {"lr": 0.1, **cli.model.hparams.optimizer["init_args"]}}
    assert cli.datamodule.padding_free and cli.datamodule.max_prompt_length == 48


class _Record(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))


def _fit(
    callbacks: list[Callback], max_steps: int = 3, resume: Path | None = None
) -> tuple[list[float], dict[str, torch.Tensor], PreferenceDataModule]:
    import random

    rng = random.Random(0)
    data = datasets.Dataset.from_list([make_preference(rng) for _ in range(12)])
    torch.manual_seed(0)
    module = DPOModule(
        preset="tiny-qwen3", tokenizer="lit-memtrain/embedded", learning_rate=0.01, warmup=0, min_lr_ratio=1.0,
        config_overrides={"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "head_dim": 16},
    )
    datamodule = PreferenceDataModule(dataset=data, batch_size=4, max_length=64)
    record = _Record()
    trainer = Trainer(
        max_steps=max_steps, accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[*callbacks, record], enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
    )
    trainer.fit(module, datamodule=datamodule, ckpt_path=resume)
    return record.losses, {n: p.detach().clone() for n, p in module.model.named_parameters()}, datamodule


def test_memory_callbacks_train_dpo_as_without_them():
    losses, weights, datamodule = _fit([])
    assert len(losses) == 3 and losses[0] == pytest.approx(0.6931, abs=1e-4)
    assert datamodule.has_reference_logps("train")
    offloading, in_effect = ActivationOffloading(offload_cpu_tensors_for_testing=True), TechniquesInEffect()
    other_losses, other_weights, _ = _fit([GradientCheckpointing(), TiledMLP(num_tiles=2), offloading, in_effect])
    in_effect.assert_in_effect(offloading=offloading)
    assert other_losses == pytest.approx(losses, rel=1e-5)
    for name, weight in weights.items():  # AdamW turns float noise in near-zero gradients into steps of lr
        torch.testing.assert_close(other_weights[name], weight, rtol=1e-3, atol=1e-3 * float(weight.abs().max()))


def test_a_resumed_dpo_run_keeps_the_initial_reference_and_the_data_position(tmp_path, capsys):
    every_two = ModelCheckpoint(tmp_path, "{step}", every_n_train_steps=2, save_top_k=-1)
    straight, weights, _ = _fit([every_two], max_steps=5)  # an epoch is three steps: resumes mid-epoch
    resumed, resumed_weights, _ = _fit([], max_steps=5, resume=tmp_path / "step=2.ckpt")
    assert resumed == pytest.approx(straight[2:], rel=1e-5)
    for name, weight in weights.items():
        torch.testing.assert_close(resumed_weights[name], weight, rtol=1e-3, atol=1e-3 * float(weight.abs().max()))

    main(["export", "--checkpoint", str(tmp_path / "step=4.ckpt"), "--output", str(tmp_path / "export")])
    assert "exported" in capsys.readouterr().out
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export").state_dict()
    saved = torch.load(tmp_path / "step=4.ckpt", weights_only=True)["state_dict"]
    assert saved.keys() == {f"model.{name}" for name in exported}  # a DPO checkpoint exports as DPOModule wrote it
    for name, weight in exported.items():
        torch.testing.assert_close(weight, saved[f"model.{name}"], rtol=0, atol=0)


def test_a_lora_fit_takes_the_reference_from_the_base_model_with_memory_callbacks():
    import random

    from lit_memtrain.models.lora import LoraSettings

    rng = random.Random(0)
    data = datasets.Dataset.from_list([make_preference(rng) for _ in range(12)])
    module = DPOModule(
        preset="tiny-qwen3", tokenizer="lit-memtrain/embedded", learning_rate=0.01, warmup=0,
        lora=LoraSettings(r=4, alpha=8, lm_head=True),
        config_overrides={"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "head_dim": 16},
    )
    datamodule = PreferenceDataModule(dataset=data, batch_size=4, max_length=64)
    record = _Record()
    trainer = Trainer(
        max_steps=6, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[GradientCheckpointing(), TiledMLP(num_tiles=2), record],
    )
    module.configure_model()
    base = {n: p.detach().clone() for n, p in module.model.named_parameters() if "lora_" not in n}
    trainer.fit(module, datamodule=datamodule)
    assert not datamodule.has_reference_logps("train")  # no pass before training: the base model, each step
    assert record.losses[0] == pytest.approx(0.6931, abs=1e-4) and record.losses[-1] < record.losses[0]
    assert float(trainer.callback_metrics["train/rewards/margins"]) > 0
    assert all(torch.equal(p, base[n]) for n, p in module.model.named_parameters() if "lora_" not in n)
