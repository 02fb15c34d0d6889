"""Optimizers and schedules through ``lit-memtrain fit`` (LightningCLI's --optimizer / --lr_scheduler), with
AdamW + warmup-cosine and no-decay groups by default, and fused AdamW only where Lightning allows it."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.plugins.precision import MixedPrecision
from torch.utils.data import DataLoader

from lit_memtrain.cli import MemTrainCLI
from lit_memtrain.datamodules.sft import SFTDataModule
from lit_memtrain.objectives.causal_lm import CausalLMModule

FIT = [
    "fit",
    "--model.preset=tiny-qwen3",
    "--data.tokenizer=lit-memtrain/embedded",
    "--data.max_length=32",
    "--data.batch_size=2",
    "--trainer.max_steps=3",
    "--trainer.accelerator=cpu",
    "--trainer.logger=false",
    "--trainer.enable_checkpointing=false",
    "--trainer.enable_progress_bar=false",
    "--trainer.limit_val_batches=0",
]


def _fit(tmp_path, *args: str) -> MemTrainCLI:
    return MemTrainCLI(CausalLMModule, SFTDataModule, args=[*FIT, f"--trainer.default_root_dir={tmp_path}", *args])


def test_the_default_is_fused_adamw_with_no_decay_groups_and_warmup_cosine(tmp_path):
    cli = _fit(tmp_path, "--model.weight_decay=0.1")
    optimizer = cli.trainer.optimizers[0]
    assert type(optimizer) is torch.optim.AdamW and optimizer.defaults["fused"]
    decay, no_decay = optimizer.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.ndim >= 2 for p in decay["params"]) and all(p.ndim < 2 for p in no_decay["params"])
    assert type(cli.trainer.lr_scheduler_configs[0].scheduler) is torch.optim.lr_scheduler.LambdaLR


def test_any_torch_optimizer_and_scheduler_from_the_command_line(tmp_path):
    cli = _fit(
        tmp_path,
        "--optimizer=SGD", "--optimizer.lr=0.1", "--optimizer.momentum=0.9", "--optimizer.weight_decay=0.01",
        "--lr_scheduler=StepLR", "--lr_scheduler.step_size=2",
    )  # fmt: skip
    optimizer = cli.trainer.optimizers[0]
    assert type(optimizer) is torch.optim.SGD and optimizer.defaults["momentum"] == 0.9
    decay, no_decay = optimizer.param_groups
    assert decay["weight_decay"] == 0.01 and no_decay["weight_decay"] == 0.0 and no_decay["params"]
    config = cli.trainer.lr_scheduler_configs[0]
    assert type(config.scheduler) is torch.optim.lr_scheduler.StepLR and config.interval == "step"
    assert decay["lr"] == pytest.approx(0.1 * 0.1)  # stepped after each of the 3 optimizer steps
    assert cli.model.hparams.optimizer["class_path"] == "torch.optim.SGD"  # saved with the checkpoint


def test_an_optimizer_alone_keeps_the_warmup_cosine_schedule(tmp_path):
    cli = _fit(tmp_path, "--optimizer=torch.optim.Adagrad", "--optimizer.lr=0.01")
    assert type(cli.trainer.optimizers[0]) is torch.optim.Adagrad
    assert type(cli.trainer.lr_scheduler_configs[0].scheduler) is torch.optim.lr_scheduler.LambdaLR


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
@pytest.mark.parametrize("name", ["AdamW8bit", "PagedAdamW8bit", "PagedAdamW"])
def test_bitsandbytes_optimizers_are_a_clear_error_without_cuda(tmp_path, name):
    with pytest.raises(RuntimeError, match=rf"lit_memtrain.objectives.optim.{name} \(bitsandbytes\) runs on CUDA only"):
        _fit(tmp_path, f"--optimizer=lit_memtrain.objectives.optim.{name}", "--optimizer.lr=1e-4")


def _batches() -> DataLoader:
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    return DataLoader([{"input_ids": ids, "labels": ids}] * 3, batch_size=None)


@pytest.mark.parametrize("clip", [None, 1.0])
def test_fp16_mixed_precision_with_gradient_clipping_trains_without_fused_adamw(tmp_path, clip):
    """Lightning's 16-mixed plugin (a GradScaler) refuses to clip with an optimizer that unscales its own
    gradients; the fused kernel is kept where it can run. (On a CPU machine, the plugin is given directly.)"""
    module = CausalLMModule(preset="tiny-qwen3")
    precision = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    trainer = Trainer(
        accelerator="cpu", plugins=[precision], gradient_clip_val=clip, max_steps=3, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, default_root_dir=tmp_path,
    )
    trainer.fit(module, _batches())
    assert trainer.global_step == 3
    assert trainer.optimizers[0].defaults["fused"] == (clip is None)
