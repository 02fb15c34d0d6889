"""Loading a checkpoint runs no code from it: export and resume load with weights_only=True, which accepts
what lit-memtrain writes (LoRA settings included) and refuses a checkpoint carrying a malicious pickle."""

from __future__ import annotations

import os
import pickle

import pytest
from pathlib import Path
import torch
from equivalence import TINY_MODEL_TERMS, assert_equal_up_to_rounding
from lightning.pytorch import Trainer
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM

from lit_memtrain.cli import main
from lit_memtrain.models.lora import LoraSettings
from lit_memtrain.objectives.causal_lm import CausalLMModule
from lit_memtrain.objectives.checkpoint_io import load_checkpoint
from lit_memtrain.objectives.dpo import DPOModule


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


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda data: data[: len(data) // 2], "truncated or not a checkpoint (no complete zip archive)"),
        (lambda data: b"", "an empty file"),
        (lambda data: b"step 4 weights\n", "truncated or not a checkpoint (no complete zip archive)"),
    ],
    ids=["truncated", "empty", "text"],
)
def test_export_names_a_checkpoint_that_cannot_be_read_in_one_line(checkpoints, tmp_path, capsys, damage, reason):
    good, _, _ = checkpoints
    broken = tmp_path / "broken.ckpt"
    broken.write_bytes(damage(good.read_bytes()))
    with pytest.raises(SystemExit) as exit_info:
        main(["export", "--checkpoint", str(broken), "--output", str(tmp_path / "export")])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip() == (
        f"lit-memtrain export: error: --checkpoint {broken} cannot be read: {reason}. Export a complete checkpoint "
        "(a save interrupted by a kill or a full disk leaves an incomplete one)."
    )
    assert not (tmp_path / "export").exists()


def test_resume_refuses_a_checkpoint_carrying_a_malicious_pickle(checkpoints, tmp_path):
    _, evil, marker = checkpoints
    module = CausalLMModule(preset="tiny-qwen3", lora=LoraSettings(r=2, alpha=4))
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        _trainer(tmp_path, max_steps=3).fit(module, _loader(), ckpt_path=evil)
    assert not marker.exists()


# Written by lit-memtrain 0.1 before its layout by role (module classes at lit_memtrain.module / lit_memtrain.dpo,
# LoraSettings pickled as lit_memtrain.lora.LoraSettings): tests/fixtures/checkpoints_0_1/README.md.
OLD_CHECKPOINTS = Path(__file__).parents[1] / "fixtures" / "checkpoints_0_1"


@pytest.mark.parametrize(
    ("name", "module_class"),
    [
        ("causal_lm_lora.ckpt", CausalLMModule),
        ("dpo.ckpt", DPOModule),
        ("fsdp2_lora.ckpt", CausalLMModule),
        ("causal_lm_embedded_tokenizer.ckpt", CausalLMModule),  # a preset that took the tokenizer's 384 rows
    ],
)
def test_checkpoints_written_before_the_move_load_and_export_the_same_model(name, module_class, tmp_path):
    module = load_checkpoint(OLD_CHECKPOINTS / name)
    assert type(module) is module_class
    assert module.lora == (LoraSettings(r=2, alpha=4) if "lora" in name else None)
    ids = torch.arange(10)[None]
    expected = torch.load(OLD_CHECKPOINTS / "expected_logits.pt")[name]  # what 0.1 computed from this checkpoint
    with torch.no_grad():  # the same weights: equal up to the float rounding of this machine's kernels
        logits = module.model.eval()(input_ids=ids, use_cache=False).logits[0, :, :8]
        assert_equal_up_to_rounding(logits, expected, name="logits", terms=TINY_MODEL_TERMS)
    main(["export", "--checkpoint", str(OLD_CHECKPOINTS / name), "--output", str(tmp_path / "export")])
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    with torch.no_grad():
        logits = exported(input_ids=ids).logits[0, :, :8]
        assert_equal_up_to_rounding(logits, expected, name="exported logits", terms=TINY_MODEL_TERMS)


def test_resuming_a_checkpoint_whose_preset_took_the_tokenizers_vocabulary_says_what_to_set(tmp_path):
    """Lightning's resume builds the model from the config before it reads the checkpoint: the 0.1 preset model of 384
    rows cannot be trained on as the 512-row preset; the error names the override that resumes it."""
    small = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
             "num_key_value_heads": 1, "head_dim": 16}  # fmt: skip
    old = OLD_CHECKPOINTS / "causal_lm_embedded_tokenizer.ckpt"
    module = CausalLMModule(preset="tiny-qwen3", config_overrides=small, tokenizer="lit-memtrain/embedded")
    with pytest.raises(ValueError, match="config_overrides.vocab_size: 384"):
        _trainer(tmp_path, max_steps=3).fit(module, _loader(), ckpt_path=old)
    module = CausalLMModule(preset="tiny-qwen3", config_overrides={**small, "vocab_size": 384},
                            tokenizer="lit-memtrain/embedded")  # fmt: skip
    trainer = _trainer(tmp_path, max_steps=3)
    trainer.fit(module, DataLoader([{"input_ids": torch.arange(12)[None], "labels": torch.arange(12)[None]}] * 4,
                                   batch_size=None), ckpt_path=old)  # fmt: skip
    assert trainer.global_step == 3
