"""DPOModule under FSDP2Strategy (CPU, gloo, 2 forked processes) against one process on the same pairs:
the reference log-probabilities precomputed by both ranks together, first-step gradients and weights."""

from __future__ import annotations

import os
import random
import time
import traceback
from pathlib import Path

import datasets
import pytest
import torch
import torch.multiprocessing as mp
from equivalence import TINY_MODEL_TERMS, assert_each_equal_up_to_rounding, assert_equal_up_to_rounding
from lightning.fabric.plugins.environments.lightning import find_free_network_port
from lightning.pytorch import Callback, Trainer
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from lit_memtrain.datamodules.embedded import make_preference
from lit_memtrain.datamodules.preference import PreferenceDataModule
from lit_memtrain.datamodules.resumable import ResumableSampler
from lit_memtrain.objectives.dpo import DPOModule
from lit_memtrain.strategies import FSDP2Strategy

WORLD, STEPS, PAIRS_PER_RANK, SEED = 2, 2, 2, 42
TIMEOUT_S = 300


class SeededDPOModule(DPOModule):
    def configure_model(self) -> None:
        if self.model is None:
            torch.manual_seed(0)
        super().configure_model()


def _module() -> SeededDPOModule:
    return SeededDPOModule(
        preset="tiny-qwen3", tokenizer="lit-memtrain/embedded", learning_rate=1e-3, warmup=0, min_lr_ratio=1.0,
        config_overrides={"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "head_dim": 16},
    )


def _datamodule(batch_size: int) -> PreferenceDataModule:
    rng = random.Random(0)
    data = datasets.Dataset.from_list([make_preference(rng) for _ in range(9)])  # odd: one rank repeats a pair
    return PreferenceDataModule(dataset=data, batch_size=batch_size, max_length=64, seed=SEED)


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().cpu().clone()


class Record(Callback):
    def __init__(self, path: Path) -> None:
        self.path, self.gradients = path, None

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.gradients is None:
            self.gradients = {n: _full(p.grad) for n, p in pl_module.named_parameters() if p.grad is not None}

    def on_train_end(self, trainer, pl_module) -> None:
        weights = {n: _full(p) for n, p in pl_module.named_parameters()}
        if trainer.is_global_zero:
            torch.save({"gradients": self.gradients, "weights": weights,
                        "reference": pl_module.reference_logps["train"]}, self.path)


def _trainer(record: Record, **options) -> Trainer:
    return Trainer(max_steps=STEPS, callbacks=[record], logger=False, enable_progress_bar=False,
                   enable_model_summary=False, enable_checkpointing=False, accelerator="cpu", **options)


def _worker(rank: int, out: Path, port: int) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(WORLD),
                       "NODE_RANK": "0", "LOCAL_RANK": str(rank)})
    torch.set_num_threads(1)
    try:
        trainer = _trainer(Record(out / "sharded.pt"), devices=WORLD, strategy=FSDP2Strategy())
        trainer.fit(_module(), datamodule=_datamodule(PAIRS_PER_RANK))
    except Exception:  # noqa: BLE001 - reported by the test
        (out / f"rank{rank}.error").write_text(traceback.format_exc())
        raise


def test_sharded_dpo_matches_one_process(tmp_path):
    context = mp.start_processes(_worker, args=(tmp_path, find_free_network_port()), nprocs=WORLD, join=False,
                                 start_method="fork")
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while not context.join(timeout=max(1.0, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the two FSDP2 processes did not finish within {TIMEOUT_S} s")
    except Exception:
        for process in context.processes:
            if process.is_alive():
                process.kill()
        if not list(tmp_path.glob("*.error")):
            raise
    for error in sorted(tmp_path.glob("*.error")):
        pytest.fail(f"the distributed run failed on {error.stem}:\n{error.read_text()}")
    sharded = torch.load(tmp_path / "sharded.pt", weights_only=True)

    # One process, each step on both ranks' pairs, the reference computed here in one pass.
    module, datamodule = _module(), _datamodule(WORLD * PAIRS_PER_RANK)
    trainer = _trainer(Record(tmp_path / "reference.pt"), devices=1)
    trainer.strategy.connect(module)
    module.trainer, trainer.datamodule = trainer, datamodule
    datamodule.setup("fit")
    module.configure_model()
    module.precompute_reference_logps()
    for sharded_values, values in zip(sharded["reference"], module.reference_logps["train"]):
        assert_equal_up_to_rounding(sharded_values, values, name="reference log-probs", terms=TINY_MODEL_TERMS)
    train = datamodule.datasets["train"]
    order = [list(ResumableSampler(train, num_replicas=WORLD, rank=r, shuffle=True, seed=SEED)) for r in range(WORLD)]
    steps = [[i for r in range(WORLD) for i in order[r][s * PAIRS_PER_RANK : (s + 1) * PAIRS_PER_RANK]] for s in range(STEPS)]
    batches = [datamodule.collator()([train[i] for i in indices]) for indices in steps]
    trainer.fit(module, DataLoader(batches, batch_size=None))
    expected = torch.load(tmp_path / "reference.pt", weights_only=True)
    assert_each_equal_up_to_rounding(sharded["gradients"], expected["gradients"], terms=TINY_MODEL_TERMS)
    for name, weight in expected["weights"].items():
        torch.testing.assert_close(sharded["weights"][name], weight, rtol=1e-3, atol=1e-3 * float(weight.abs().max()))
