import csv

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM

from lit_memtrain.callbacks.memory_bounded_throughput import MemoryBoundedThroughput
from lit_memtrain.objectives.causal_lm import CausalLMModule
from lit_memtrain.models.presets import build_config


def _batches(lengths: list[int]) -> list[dict[str, torch.Tensor]]:
    """One row per batch, padded to 16; ``lengths`` real tokens each."""
    batches = []
    for n in lengths:
        mask = torch.zeros(1, 16, dtype=torch.long)
        mask[0, :n] = 1
        ids = torch.randint(1, 500, (1, 16)) * mask
        batches.append({"input_ids": ids, "labels": ids.masked_fill(mask == 0, -100), "attention_mask": mask})
    return batches


def _fit(callback: MemoryBoundedThroughput, lengths: list[int], tmp_path) -> dict[str, float]:
    torch.manual_seed(0)
    trainer = Trainer(
        accelerator="cpu",
        max_steps=len(lengths),
        log_every_n_steps=1,
        callbacks=[callback],
        logger=CSVLogger(tmp_path, name="", version=""),
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    module = CausalLMModule(preset="tiny-qwen3")
    module.configure_model()
    trainer.fit(module, DataLoader(_batches(lengths), batch_size=None))
    with (tmp_path / "metrics.csv").open() as file:
        rows = [row for row in csv.DictReader(file) if row.get("sweep/objective")]
    return {key: float(value) for key, value in rows[-1].items() if key.startswith("sweep/")} if rows else {}


def test_throughput_counts_the_tokens_after_warmup_and_passes_within_the_bound(tmp_path):
    metrics = _fit(MemoryBoundedThroughput(max_memory_gib=1024, warmup_steps=2), [3, 5, 7, 11, 13], tmp_path)
    assert metrics["sweep/tokens"] == 7 + 11 + 13
    assert metrics["sweep/within_memory_bound"] == 1.0
    assert metrics["sweep/objective"] == metrics["sweep/tokens_per_sec"] > 0
    assert 0.05 < metrics["sweep/peak_memory_gib"] < 64  # the process's resident memory, in GiB


def test_a_run_over_the_bound_scores_zero(tmp_path):
    metrics = _fit(MemoryBoundedThroughput(max_memory_gib=0.001, warmup_steps=1), [4, 4, 4], tmp_path)
    assert metrics["sweep/tokens"] == 8
    assert metrics["sweep/within_memory_bound"] == 0.0
    assert metrics["sweep/objective"] == 0.0 and metrics["sweep/tokens_per_sec"] > 0


def test_training_shorter_than_the_warmup_warns_and_logs_nothing(tmp_path):
    with pytest.warns(UserWarning, match="training ended at step 2, before warmup_steps=5"):
        metrics = _fit(MemoryBoundedThroughput(max_memory_gib=10, warmup_steps=5), [4, 4], tmp_path)
    assert metrics == {}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_memory_gib": 0}, "max_memory_gib must be a positive"),
        ({"max_memory_gib": 1, "warmup_steps": -1}, "warmup_steps must be an int >= 0"),
    ],
)
def test_invalid_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MemoryBoundedThroughput(**kwargs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_peak_is_the_allocators_reserved_peak(tmp_path):
    torch.cuda.reset_peak_memory_stats()
    callback = MemoryBoundedThroughput(max_memory_gib=1024, warmup_steps=1)
    trainer = Trainer(
        accelerator="gpu", devices=1, max_steps=3, callbacks=[callback],
        logger=CSVLogger(tmp_path, name="", version=""), log_every_n_steps=1,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
    )
    trainer.fit(CausalLMModule(preset="tiny-qwen3"), DataLoader(_batches([4, 8, 12]), batch_size=None))
    with (tmp_path / "metrics.csv").open() as file:
        (row,) = [row for row in csv.DictReader(file) if row.get("sweep/objective")]
    assert float(row["sweep/tokens"]) == 8 + 12
    assert 0 < float(row["sweep/peak_memory_gib"]) * 2**30 <= torch.cuda.max_memory_reserved()


class _UsersOwnModule(LightningModule):
    """A plain LightningModule holding a Hugging Face causal LM, as a user would write it."""

    def __init__(self) -> None:
        super().__init__()
        self.model = AutoModelForCausalLM.from_config(build_config("tiny-qwen3"))

    def training_step(self, batch, batch_idx):
        return self.model(**batch, use_cache=False).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_works_on_a_users_own_module_and_never_imports_ours(tmp_path):
    import ast
    from pathlib import Path

    import lit_memtrain.callbacks.memory_bounded_throughput as callback_module

    imported = {
        node.module for node in ast.walk(ast.parse(Path(callback_module.__file__).read_text()))
        if isinstance(node, ast.ImportFrom)
    }
    assert "lit_memtrain.objectives.causal_lm" not in imported
    torch.manual_seed(0)
    trainer = Trainer(
        accelerator="cpu", max_steps=4, log_every_n_steps=1, logger=CSVLogger(tmp_path, name="", version=""),
        callbacks=[MemoryBoundedThroughput(max_memory_gib=1024, warmup_steps=1)],
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
    )
    trainer.fit(_UsersOwnModule(), DataLoader(_batches([3, 5, 7, 9]), batch_size=None))
    with (tmp_path / "metrics.csv").open() as file:
        rows = [row for row in csv.DictReader(file) if row.get("sweep/objective")]
    assert float(rows[-1]["sweep/tokens"]) == 5 + 7 + 9
    assert float(rows[-1]["sweep/objective"]) > 0


def test_an_online_rl_fit_whose_batches_hold_prompts_is_refused_saying_why(tmp_path):
    """A GRPO batch holds prompts (its trained tokens are generated in the step): counting them would score the sweep
    on prompt tokens; the callback says so instead of a KeyError."""
    import datasets

    from lit_memtrain.datamodules.prompts import PromptDataModule
    from lit_memtrain.objectives.grpo import GRPOModule

    module = GRPOModule(preset="tiny-qwen3", tokenizer="lit-memtrain/embedded", num_generations=2,
                        reward_funcs=[lambda completions, **kwargs: [float(len(c)) for c in completions]])  # fmt: skip
    trainer = Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                      callbacks=[MemoryBoundedThroughput(max_memory_gib=1, warmup_steps=0)])  # fmt: skip
    prompts = datasets.Dataset.from_list([{"prompt": f"{i} + 1 ="} for i in range(4)])
    with pytest.raises(ValueError, match=r"none \(\['columns', 'prompt', 'prompt_ids'\]\): an online-RL batch"):
        trainer.fit(module, datamodule=PromptDataModule(dataset=prompts, batch_size=2, seed=0))
