"""ExactAnswerAccuracy's arguments, and its completions under FSDP2 (its scores are tested through
``lit-memtrain fit`` in tests/cli)."""

import json
from pathlib import Path

import pytest
import torch
from gloo_ranks import run_on_gloo_ranks
from lightning.pytorch import Callback, Trainer
from torch.utils.data import DataLoader

from lit_memtrain.callbacks import ExactAnswerAccuracy
from lit_memtrain.datamodules.collate import PaddedCollator
from lit_memtrain.datamodules.embedded import ADDITION_HELDOUT
from lit_memtrain.models.generate import greedy_completions
from lit_memtrain.models.lora import LoraSettings
from lit_memtrain.objectives.answer_accuracy import load_answer_prompts
from lit_memtrain.objectives.causal_lm import CausalLMModule
from lit_memtrain.strategies import FSDP2Strategy

PROMPTS = 4


def test_the_callback_refuses_an_empty_measure():
    with pytest.raises(ValueError, match="must be at least 1; got 0, 8 and 50"):
        ExactAnswerAccuracy(num_prompts=0)


class _Seeded(CausalLMModule):
    """A LoRA model built from seed 0 wherever it is built, its head untied (a random tied model repeats one token)."""

    def __init__(self) -> None:
        super().__init__(preset="tiny-qwen3", tokenizer="lit-memtrain/embedded", lora=LoraSettings(r=4, alpha=8),
                         config_overrides={"tie_word_embeddings": False}, learning_rate=1e-3, warmup=0)  # fmt: skip

    def configure_model(self) -> None:
        if self.model is None:
            torch.manual_seed(0)
        super().configure_model()


def _completions(module: CausalLMModule) -> list[str]:
    prompts = [row["prompt"] for row in load_answer_prompts(ADDITION_HELDOUT, PROMPTS)]
    return greedy_completions(module.model, module.tokenizer, prompts, 4, batch_size=PROMPTS)


class _Completions(Callback):
    """Writes rank 0's greedy completions at fit start, as ExactAnswerAccuracy generates them."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_fit_start(self, trainer: Trainer, pl_module: CausalLMModule) -> None:
        completions = _completions(pl_module)
        if trainer.is_global_zero:
            self.path.write_text(json.dumps(completions))


def _sharded_fit(rank: int, out: Path) -> None:
    rows = [PaddedCollator(0)([{"input_ids": list(range(5, 13)), "labels": list(range(5, 13))}]) for _ in range(2)]
    trainer = Trainer(
        max_steps=1, accelerator="cpu", devices=2, strategy=FSDP2Strategy(), use_distributed_sampler=False,
        callbacks=[ExactAnswerAccuracy(num_prompts=PROMPTS, max_new_tokens=4), _Completions(out / "sharded.json")],
        logger=False, enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(_Seeded(), DataLoader(rows, batch_size=None))


def test_a_lora_model_sharded_by_fsdp2_is_scored_with_the_completions_of_the_whole_model(tmp_path):
    """PEFT's generate calls the wrapped model's forward, never the root's, where FSDP2 gathers the embeddings: the
    callback failed at fit start (mixed Tensor and DTensor) under a sharded LoRA fit."""
    reference = _Seeded()
    reference.configure_model()
    expected = _completions(reference)
    assert len(set(expected)) > 1
    run_on_gloo_ranks(_sharded_fit, (tmp_path,), world=2, errors=tmp_path, timeout_s=400)
    assert json.loads((tmp_path / "sharded.json").read_text()) == expected
