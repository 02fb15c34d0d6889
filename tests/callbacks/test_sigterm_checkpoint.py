"""SigtermCheckpoint with gradient accumulation: a SIGTERM that comes while an optimizer step's micro-batches run
stops the fit once that step is taken, so the saved checkpoint resumes into exactly the uninterrupted run.

Lightning alone stops after the micro-batch running: the checkpoint then holds no trace of the step's gradients so
far, and the resumed run took that step on its remaining micro-batches only (weights 2e-3 away after 5 steps; 3e-3
after 4 steps on two FSDP2 ranks)."""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

import pytest
import torch
from gloo_ranks import run_on_gloo_ranks, whole_on_host
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


def _examples(rank: int, count: int = 4 * STEPS) -> list[dict[str, list[int]]]:
    generator = torch.Generator().manual_seed(rank)
    rows = [torch.randint(1, 512, (16,), generator=generator).tolist() for _ in range(count)]
    return [{"input_ids": ids, "labels": [-100] * (2 + 9 * rank) + ids[2 + 9 * rank :]} for ids in rows]


def _sharded_fit(rank: int, root: Path, *callbacks: Callback, ckpt_path: Path | None = None) -> None:
    """Two FSDP2 ranks, each on its own rows (a resumable loader of 2 rows a micro-batch, 2 micro-batches a step);
    rank 0 writes the whole weights at the end."""
    from lit_memtrain.datamodules.collate import PaddedCollator
    from lit_memtrain.datamodules.resumable import ResumableDataLoader, ResumableSampler
    from lit_memtrain.strategies import FSDP2Strategy

    torch.manual_seed(0)
    module = CausalLMModule(preset="tiny-qwen3", learning_rate=1e-3, warmup=0, min_lr_ratio=1.0)
    trainer = Trainer(
        max_steps=STEPS, accumulate_grad_batches=ACCUMULATE, accelerator="cpu", devices=2,
        strategy=FSDP2Strategy(cpu_offload=True), use_distributed_sampler=False, logger=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=root,
        callbacks=[ModelCheckpoint(root / "checkpoints", every_n_train_steps=100), SigtermCheckpoint(), *callbacks],
    )  # fmt: skip
    rows = _examples(rank)
    loader = ResumableDataLoader(
        rows, batch_size=2, sampler=ResumableSampler(rows, shuffle=False), collate_fn=PaddedCollator(pad_token_id=0),
        consumed_batches=lambda: trainer.fit_loop.epoch_loop.batch_progress.current.processed,
    )  # fmt: skip
    with pytest.raises(SIGTERMException) if callbacks else contextlib.nullcontext():
        trainer.fit(module, loader, ckpt_path=ckpt_path)
    weights = {name: whole_on_host(p) for name, p in module.named_parameters()}
    if trainer.is_global_zero:
        torch.save(weights, root / "weights.pt")


def _sharded_worker(rank: int, root: Path, phase: str) -> None:
    if phase == "straight":
        _sharded_fit(rank, root / "straight")
    elif phase == "stopped":  # every rank gets the signal, as from a scheduler
        _sharded_fit(rank, root / "stopped", SigtermDuringMicroBatch(5))
    else:
        (saved,) = (root / "stopped" / "checkpoints").glob("sigterm-step=*.ckpt")
        _sharded_fit(rank, root / "stopped", ckpt_path=saved)


def test_two_sharded_ranks_stopped_inside_an_accumulated_step_resume_into_the_uninterrupted_run(tmp_path):
    """Under FSDP2 Lightning also checks rank 0's flag before each batch (a broadcast): the held stop must keep
    every rank in the step, and the distributed checkpoint saved after it must resume exactly."""
    for phase in ("straight", "stopped", "resumed"):
        (tmp_path / phase).mkdir(exist_ok=True)
        run_on_gloo_ranks(_sharded_worker, (tmp_path, phase), world=2, errors=tmp_path / phase, timeout_s=240)
    straight = torch.load(tmp_path / "straight" / "weights.pt", weights_only=True)
    resumed = torch.load(tmp_path / "stopped" / "weights.pt", weights_only=True)
    for name, expected in straight.items():
        torch.testing.assert_close(resumed[name], expected, rtol=0, atol=0, msg=name)
    assert sorted(path.name for path in (tmp_path / "stopped" / "checkpoints").glob("*")) == ["sigterm-step=3.ckpt"]
