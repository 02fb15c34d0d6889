"""GRPO whose accumulation windows cross training batches (``gradient_accumulation_steps=2``, 3 micro-batches a batch):
a batch may end after an optimizer step with the next window open, whose gradients no checkpoint holds.

SIGTERM then stops the fit only once a window is closed, so the resumed fit is the uninterrupted one; a checkpoint
saved with a window open says that a fit resumed from it differs (before: silently, weights 5e-3 away after 4 steps).
"""

from __future__ import annotations

import os
import random
import signal
from pathlib import Path

import datasets
import pytest
import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lit_memtrain.callbacks.sigterm_checkpoint import SigtermCheckpoint
from lit_memtrain.datamodules.embedded import make_arithmetic_prompt
from lit_memtrain.datamodules.prompts import PromptDataModule
from lit_memtrain.models.generation import SamplingSettings, TransformersGenerate
from lit_memtrain.objectives.grpo import GRPOModule

STEPS = 4  # 2 training batches of 3 micro-batches make 3 optimizer steps


def _by_position(completions, **kwargs):
    return [float(i % 2) + len(c) / 10 for i, c in enumerate(completions)]


class SigtermAtFirstBatch(Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == 0:
            os.kill(os.getpid(), signal.SIGTERM)


def _fit(root: Path, *callbacks: Callback, max_steps: int = STEPS, ckpt_path: Path | None = None) -> GRPOModule:
    seed_everything(0)
    sampling = SamplingSettings(max_completion_length=6, do_sample=True, temperature=1.0)
    module = GRPOModule(
        preset="tiny-qwen3", tokenizer="lit-memtrain/embedded", learning_rate=1e-3, warmup=0, min_lr_ratio=1.0,
        config_overrides={"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "head_dim": 16},
        reward_funcs=[_by_position], num_generations=2, generation_backend=TransformersGenerate(sampling, [2], 0),
        steps_per_generation=3, gradient_accumulation_steps=2,
    )  # fmt: skip
    rng = random.Random(0)
    prompts = datasets.Dataset.from_list([make_arithmetic_prompt(rng) for _ in range(24)])
    trainer = Trainer(
        max_steps=max_steps, logger=False, enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
        devices=1, default_root_dir=root,
        callbacks=[ModelCheckpoint(root / "checkpoints", "{step}", every_n_train_steps=1, save_top_k=-1),
                   SigtermCheckpoint(), *callbacks],
    )  # fmt: skip
    datamodule = PromptDataModule(dataset=prompts, batch_size=3, seed=0, max_prompt_length=None)
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    except SIGTERMException:
        assert callbacks, "only the fit sent a SIGTERM stops on one"
    return module


def test_a_checkpoint_saved_with_a_window_open_says_a_resumed_fit_differs(tmp_path):
    with pytest.warns(UserWarning, match=r"at step 1 with 1 micro-batch\(es\) of the next optimizer step already"):
        _fit(tmp_path, max_steps=2)  # the first batch ends after step 1, step 2 open
    assert torch.load(tmp_path / "checkpoints" / "step=1.ckpt", weights_only=True)["lit_memtrain"]["micro_steps"] == 3


def test_sigterm_inside_an_open_window_stops_once_it_is_closed_and_resumes_into_the_uninterrupted_fit(tmp_path):
    straight = _fit(tmp_path / "straight")
    _fit(tmp_path / "stopped", SigtermAtFirstBatch())  # the first batch ends after step 1 with step 2's window open
    saved = sorted(path.name for path in (tmp_path / "stopped" / "checkpoints").glob("sigterm-*"))
    assert saved == ["sigterm-step=3.ckpt"]
    resumed = _fit(tmp_path / "stopped", ckpt_path=tmp_path / "stopped" / "checkpoints" / "sigterm-step=3.ckpt")
    for (name, expected), (_, got) in zip(straight.named_parameters(), resumed.named_parameters(), strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=0, msg=name)
