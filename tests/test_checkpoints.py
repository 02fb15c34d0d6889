"""Loading a checkpoint runs no code from it: export and resume load with weights_only=True, which accepts
what lit-memtrain writes (LoRA settings included) and refuses a checkpoint carrying a malicious pickle."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
from lightning.pytorch import Trainer
from torch.utils.data import DataLoader

from lit_memtrain.cli import main
from lit_memtrain.lora import LoraSettings
from lit_memtrain.module import CausalLMModule, load_checkpoint


class _RunsCode:
    """What an attacker would put in a checkpoint: unpickling it calls a function (here: makes a directory)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def _loader() -> DataLoader:
    ids = torch.randint(0, 512, (1, 12), generator=torch.Generator().manual_seed(0))
    return DataLoader([{"input_ids": ids, "labels": ids}] * 4, batch_size=None)


def _trainer(tmp_path, max_steps: int) -> Trainer:
    return Trainer(
        max_steps=max_steps, logger=False, enable_progress_bar=False, enable_checkpointing=False, default_root_dir=tmp_path
    )


@pytest.fixture
def checkpoints(tmp_path):
    """A LoRA run's checkpoint written through the Python API (LoraSettings in its hyper-parameters), and the
    same checkpoint with a malicious object added."""
    module = CausalLMModule(preset="tiny-qwen3", lora=LoraSettings(r=2, alpha=4))
    trainer = _trainer(tmp_path, max_steps=2)
    trainer.fit(module, _loader())
    trainer.save_checkpoint(tmp_path / "run.ckpt")
    checkpoint = torch.load(tmp_path / "run.ckpt", weights_only=True)
    assert isinstance(checkpoint["hyper_parameters"]["lora"], LoraSettings)
    checkpoint["hyper_parameters"]["note"] = _RunsCode(str(tmp_path / "pwned"))
    torch.save(checkpoint, tmp_path / "evil.ckpt")
    return tmp_path / "run.ckpt", tmp_path / "evil.ckpt", tmp_path / "pwned"


def test_export_and_resume_load_lit_memtrains_own_checkpoints_with_weights_only(checkpoints, tmp_path):
    good, _, _ = checkpoints
    restored = load_checkpoint(good)
    assert restored.lora == LoraSettings(r=2, alpha=4) and restored.train_tokens_seen == 2 * 12
    import fsspec

    with fsspec.open("memory://run.ckpt", "wb") as remote:  # a remote path, as load_from_checkpoint takes it
        remote.write(good.read_bytes())
    assert load_checkpoint("memory://run.ckpt").train_tokens_seen == 2 * 12
    main(["export", "--checkpoint", str(good), "--output", str(tmp_path / "export")])
    assert (tmp_path / "export" / "config.json").exists()
    module = CausalLMModule(preset="tiny-qwen3", lora=LoraSettings(r=2, alpha=4))
    trainer = _trainer(tmp_path, max_steps=3)
    trainer.fit(module, _loader(), ckpt_path=good)  # Lightning's resume: torch.load's default, weights_only=True
    assert trainer.global_step == 3 and module.train_tokens_seen == 3 * 12


def test_export_refuses_a_checkpoint_carrying_a_malicious_pickle(checkpoints, tmp_path, capsys):
    _, evil, marker = checkpoints
    with pytest.raises(SystemExit) as exit_info:
        main(["export", "--checkpoint", str(evil), "--output", str(tmp_path / "export")])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert f"Refused to load {str(evil)!r}" in error and "mkdir" in error and "weights_only=False" in error
    assert not marker.exists() and not (tmp_path / "export").exists()
    with pytest.raises(pickle.UnpicklingError, match="Refused to load"):
        load_checkpoint(evil)


def test_resume_refuses_a_checkpoint_carrying_a_malicious_pickle(checkpoints, tmp_path):
    _, evil, marker = checkpoints
    module = CausalLMModule(preset="tiny-qwen3", lora=LoraSettings(r=2, alpha=4))
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        _trainer(tmp_path, max_steps=3).fit(module, _loader(), ckpt_path=evil)
    assert not marker.exists()
