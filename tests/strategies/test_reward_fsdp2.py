"""RewardModule under FSDP2Strategy(start_method="fork") (CPU, gloo, 2 processes forked by Lightning's launcher)
against one process on the same pairs: the first step's gradients, the weights after training, and the training and
validation metrics, which every rank logs for all ranks' pairs; the sharded model's export (gathered on rank 0) is a
sequence classifier holding the trained weights."""

from __future__ import annotations

import random
from pathlib import Path

import datasets
import pytest
import torch
from equivalence import TINY_MODEL_TERMS, assert_each_equal_up_to_rounding, assert_equal_up_to_rounding
from lightning.pytorch import Callback, Trainer
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader
from transformers import AutoModelForSequenceClassification

from lit_memtrain.datamodules.embedded import make_preference
from lit_memtrain.datamodules.preference import PreferenceDataModule
from lit_memtrain.datamodules.resumable import ResumableSampler
from lit_memtrain.objectives.reward import RewardModule
from lit_memtrain.strategies import FSDP2Strategy

WORLD, STEPS, PAIRS_PER_RANK, SEED = 2, 2, 2, 42


class SeededRewardModule(RewardModule):
    def configure_model(self) -> None:
        if self.model is None:
            torch.manual_seed(0)
        super().configure_model()


def _module(**options) -> SeededRewardModule:
    return SeededRewardModule(
        preset="tiny-qwen3", tokenizer="lit-memtrain/embedded", learning_rate=1e-3, warmup=0, min_lr_ratio=1.0,
        center_rewards_coefficient=0.01,
        config_overrides={"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "head_dim": 16},
        **options,
    )


def _datamodule(batch_size: int) -> PreferenceDataModule:
    rng = random.Random(0)
    data = datasets.Dataset.from_list([make_preference(rng) for _ in range(13)])  # 9 to train on: one rank repeats
    return PreferenceDataModule(dataset=data, batch_size=batch_size, max_length=64, seed=SEED, val_size=4,
                                long_pairs="drop")


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().cpu().clone()


class Record(Callback):
    def __init__(self, path: Path) -> None:
        self.path, self.gradients, self.train_metrics = path, None, []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.gradients is None:
            self.gradients = {n: _full(p.grad) for n, p in pl_module.named_parameters() if p.grad is not None}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.train_metrics.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("train/")})

    def on_train_end(self, trainer, pl_module) -> None:
        weights = {n: _full(p) for n, p in pl_module.named_parameters()}
        validation = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
        if trainer.is_global_zero:
            torch.save({"gradients": self.gradients, "weights": weights, "train": self.train_metrics,
                        "validation": validation}, self.path)


def _trainer(record: Record, **options) -> Trainer:
    return Trainer(max_steps=STEPS, callbacks=[record], logger=False, enable_progress_bar=False,
                   enable_model_summary=False, enable_checkpointing=False, accelerator="cpu", num_sanity_val_steps=0,
                   val_check_interval=STEPS, check_val_every_n_epoch=None, **options)


def test_sharded_reward_training_matches_one_process(tmp_path):
    sharded_data = _datamodule(PAIRS_PER_RANK)
    sharded_data.setup("fit")  # tokenized once, before the fork
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        trainer = _trainer(Record(tmp_path / "sharded.pt"), devices=WORLD, strategy=FSDP2Strategy(start_method="fork"))
        trainer.fit(_module(export_dir=str(tmp_path / "export")), datamodule=sharded_data)
    finally:
        torch.set_num_threads(threads)
    sharded = torch.load(tmp_path / "sharded.pt", weights_only=True)

    # One process, each step on both ranks' pairs, validation on the whole validation set in one batch.
    datamodule = _datamodule(WORLD * PAIRS_PER_RANK)
    datamodule.setup("fit")
    train, validation = datamodule.datasets["train"], datamodule.datasets["validation"]
    order = [list(ResumableSampler(train, num_replicas=WORLD, rank=r, shuffle=True, seed=SEED)) for r in range(WORLD)]
    steps = [
        [i for r in range(WORLD) for i in order[r][s * PAIRS_PER_RANK : (s + 1) * PAIRS_PER_RANK]] for s in range(STEPS)
    ]
    batches = [datamodule.collator()([train[i] for i in indices]) for indices in steps]
    val_batch = datamodule.collator()([validation[i] for i in range(len(validation))])
    trainer = _trainer(Record(tmp_path / "reference.pt"), devices=1)
    trainer.fit(_module(), DataLoader(batches, batch_size=None), DataLoader([val_batch], batch_size=None))
    expected = torch.load(tmp_path / "reference.pt", weights_only=True)

    assert_each_equal_up_to_rounding(sharded["gradients"], expected["gradients"], terms=TINY_MODEL_TERMS)
    for name, weight in expected["weights"].items():
        torch.testing.assert_close(sharded["weights"][name], weight, rtol=1e-3, atol=1e-3 * float(weight.abs().max()))
    first, reference_first = sharded["train"][0], expected["train"][0]  # the first step: the same weights
    assert first.keys() == reference_first.keys() and "train/accuracy" in first
    rewards = max(abs(reference_first["train/min_reward"]), abs(reference_first["train/max_reward"]))
    for name in ("train/loss", "train/accuracy", "train/margin", "train/min_reward", "train/max_reward"):
        value = reference_first[name]  # the margin is a difference of rewards: rounded at their magnitude
        assert_equal_up_to_rounding(first[name], value, name=name, terms=TINY_MODEL_TERMS, scale=rewards)
    exported = AutoModelForSequenceClassification.from_pretrained(tmp_path / "export")
    assert exported.config.num_labels == 1
    for name, weight in exported.state_dict().items():  # what the ranks trained, gathered
        torch.testing.assert_close(weight, sharded["weights"][f"model.{name}"], rtol=0, atol=0, msg=name)
    assert sharded["validation"].keys() == expected["validation"].keys() and "val/accuracy" in expected["validation"]
    for name, value in expected["validation"].items():
        assert sharded["validation"][name] == pytest.approx(value, rel=1e-3, abs=1e-4), name
