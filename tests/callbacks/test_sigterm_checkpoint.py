"""SigtermCheckpoint with gradient accumulation: a SIGTERM that comes while an optimizer step's micro-batches run
stops the fit once that step is taken, so the saved checkpoint resumes into exactly the uninterrupted run.

Lightning alone stops after the micro-batch running: the checkpoint then holds no trace of the step's gradients so
far, and the resumed run took that step on its remaining micro-batches only (weights 2e-3 away after 5 steps)."""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lit_memtrain.callbacks.sigterm_checkpoint import SigtermCheckpoint
from lit_memtrain.datamodules.sft import SFTDataModule
from lit_memtrain.objectives.causal_lm import CausalLMModule

ACCUMULATE = 2
STEPS = 5


class SigtermDuringMicroBatch(Callback):
    """Sends this process a real SIGTERM during the backward of the ``micro_batch``-th micro-batch (1-based)."""

    def __init__(self, micro_batch: int) -> None:
        self.micro_batch = micro_batch
        self.seen = 0

    def on_train_batch_start(self, *args) -> None:
        self.seen += 1

    def on_after_backward(self, *args) -> None:
        if self.seen == self.micro_batch:
            os.kill(os.getpid(), signal.SIGTERM)


def _fit(root: Path, *callbacks: Callback, ckpt_path: Path | None = None) -> CausalLMModule:
    torch.manual_seed(0)
    module = CausalLMModule(preset="tiny-qwen3", tokenizer="lit-memtrain/embedded", learning_rate=1e-3, warmup=0)
    trainer = Trainer(
        max_steps=STEPS, accumulate_grad_batches=ACCUMULATE, accelerator="cpu", devices=1, logger=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
        callbacks=[ModelCheckpoint(root / "checkpoints", every_n_train_steps=100), SigtermCheckpoint(), *callbacks],
        default_root_dir=root,
    )  # fmt: skip
    with pytest.raises(SIGTERMException) if callbacks else contextlib.nullcontext():
        trainer.fit(module, datamodule=SFTDataModule(max_length=32, batch_size=2), ckpt_path=ckpt_path)
    return module


@pytest.mark.parametrize(("micro_batch", "saved_step"), [(5, 3), (4, 2)])
def test_a_sigterm_inside_an_accumulated_step_saves_after_it_and_resumes_into_the_uninterrupted_run(
    tmp_path, micro_batch, saved_step
):
    """Micro-batch 5 opens step 3: the fit stops once step 3 is taken. Micro-batch 4 closes step 2: it stops there."""
    straight = _fit(tmp_path / "straight")
    _fit(tmp_path / "stopped", SigtermDuringMicroBatch(micro_batch))
    saved = sorted((tmp_path / "stopped" / "checkpoints").glob("sigterm-step=*.ckpt"))
    assert [path.name for path in saved] == [f"sigterm-step={saved_step}.ckpt"]
    resumed = _fit(tmp_path / "stopped", ckpt_path=saved[0])
    assert resumed.train_tokens_seen == straight.train_tokens_seen
    assert resumed.last_train_loss == straight.last_train_loss
    for (name, expected), (_, got) in zip(straight.named_parameters(), resumed.named_parameters(), strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=0, msg=name)
