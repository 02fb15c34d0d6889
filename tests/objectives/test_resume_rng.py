"""A resumed fit that samples (GRPO, completions drawn by ``generate`` with ``do_sample=True``) draws the random numbers
the uninterrupted fit would: the same completions at every resumed step and the same weights at the end, resumed in
the middle of an epoch and at an epoch's end.

Lightning saves no generator state and ``seed_everything`` (``lit-memtrain fit`` seeds every fit) seeds a resumed fit as
at its first step: the resumed steps then sampled the completions of the run's first steps again (weights 3e-3 away
after 4 steps)."""

from __future__ import annotations

import random
from pathlib import Path

import datasets
import pytest
import torch
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint

from lit_memtrain.datamodules.embedded import make_arithmetic_prompt
from lit_memtrain.datamodules.prompts import PromptDataModule
from lit_memtrain.models.generation import SamplingSettings, TransformersGenerate
from lit_memtrain.objectives.grpo import GRPOModule

STEPS = 6  # an epoch is 4 steps (8 prompts, 2 a step)


def _by_position(completions, **kwargs):
    """Differs within every group of 2, so every step has advantages to train on."""
    return [float(i % 2) + len(c) / 10 for i, c in enumerate(completions)]


class Recording(GRPOModule):
    def generate_rollout(self, batch, where):
        rollout, rewards, metrics = super().generate_rollout(batch, where)
        self.completions.setdefault(self.global_step + 1, []).extend(rollout.completion_ids)
        return rollout, rewards, metrics


def _fit(root: Path, max_steps: int, ckpt_path: Path | None = None) -> Recording:
    seed_everything(0)  # as lit-memtrain fit does, resumed or not
    sampling = SamplingSettings(max_completion_length=6, do_sample=True, temperature=1.0)
    module = Recording(
        preset="tiny-qwen3", tokenizer="lit-memtrain/embedded", learning_rate=1e-3, warmup=0, min_lr_ratio=1.0,
        config_overrides={"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "head_dim": 16},
        reward_funcs=[_by_position], num_generations=2, generation_backend=TransformersGenerate(sampling, [2], 0),
    )  # fmt: skip
    module.completions = {}
    rng = random.Random(0)
    prompts = datasets.Dataset.from_list([make_arithmetic_prompt(rng) for _ in range(8)])
    trainer = Trainer(
        max_steps=max_steps, logger=False, enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
        devices=1, default_root_dir=root,
        callbacks=[ModelCheckpoint(root / "checkpoints", "{step}", every_n_train_steps=1, save_top_k=-1)],
    )  # fmt: skip
    datamodule = PromptDataModule(dataset=prompts, batch_size=2, seed=0, max_prompt_length=None)
    trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    return module


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Recording:
    return _fit(tmp_path_factory.mktemp("straight"), STEPS)


@pytest.mark.parametrize("stop", [2, 4])  # in the middle of the first epoch; at its end
def test_a_resumed_sampling_fit_draws_what_the_uninterrupted_one_would(straight, tmp_path, stop):
    _fit(tmp_path, stop)
    resumed = _fit(tmp_path, STEPS, ckpt_path=tmp_path / "checkpoints" / f"step={stop}.ckpt")
    assert sorted(resumed.completions) == list(range(stop + 1, STEPS + 1))
    assert len({str(straight.completions[step]) for step in straight.completions}) == STEPS  # sampled, step by step
    for step in resumed.completions:
        assert resumed.completions[step] == straight.completions[step], step
    for (name, expected), (_, got) in zip(straight.named_parameters(), resumed.named_parameters(), strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=0, msg=name)
