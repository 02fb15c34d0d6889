"""Two ranks (gloo) driven the way a user drives them, against one process on the same data, loss and weights.

- ``ContextParallelStrategy(2)`` (Ulysses and ring) fed by ``SFTDataModule(packing=True)``: packed rows whose
  documents cross the shard boundaries (and rows the strategy pads), two micro-batches a step, validation through
  the datamodule after each of the epoch's three steps. Every micro-batch's loss, every validation's metrics, the
  tokens trained and each weight's change over the epoch must be one process's.
- ``Trainer(gradient_clip_val=...)`` under ``FSDP2Strategy`` (with and without ``cpu_offload``) and
  ``ContextParallelStrategy(2)``: the norm is taken over every rank's shard, so with SGD at lr 1 each weight's
  change is minus one process's gradient scaled to the clip norm (the clip is small enough to bind, which the
  test asserts).

Every case runs in one launch: two processes forked from pytest fit one case after another, and rank 0 writes what
it saw; the one-process references run here, once each. SGD makes each weight's change linear in the gradients, so
fp32 rounding on any CPU stays far below the 1e-4 (of each tensor's largest change) the changes are compared to.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import datasets
import pytest
import torch
from equivalence import TINY_MODEL_TERMS, assert_each_equal_up_to_rounding
from gloo_ranks import run_on_gloo_ranks, whole_on_host
from lightning.pytorch import Trainer
from test_fsdp2 import Record, SeededModule, assert_tokens_trained

from lit_memtrain.datamodules.sft import SFTDataModule
from lit_memtrain.parallel.context_parallel.sharding import padded_length, rank_chunks
from lit_memtrain.strategies import ContextParallelStrategy, FSDP2Strategy

WORLD = 2
LAUNCH_TIMEOUT_S = 300
ACCUMULATE = 2
VALIDATE_EVERY = 2  # micro-batches: after each of the epoch's three steps
CLIP = 1.0  # well below the first step's gradient norm (asserted): clipping binds

# 20 training examples packed into 6 rows of 10 to 40 tokens, each of 2 to 5 documents; 4 validation examples
# packed into 2 rows. The strategy pads one row for Ulysses (37 tokens, to 38) and three for ring (to a multiple
# of 4), and in every row a document crosses a shard boundary (but one row for Ulysses: two documents of 5 tokens,
# cut between them).
EXAMPLES = [{"prompt": f"Q{i}:" + " a" * (i % 3), "completion": " b" * (1 + (7 * i) % 9)} for i in range(24)]
ROWS, VALIDATION_ROWS = 6, 2
PADDED_AND_SPLIT_ROWS = {"ulysses": (1, 5), "ring": (3, 6)}


def _datamodule(batch_size: int = 1) -> SFTDataModule:
    return SFTDataModule(
        tokenizer="lit-memtrain/embedded", dataset=datasets.Dataset.from_list(EXAMPLES), packing=True, max_length=40,
        val_size=4, batch_size=batch_size, seed=3,
    )  # fmt: skip


def _module(learning_rate: float) -> SeededModule:
    sgd = {"class_path": "torch.optim.SGD", "init_args": {"lr": learning_rate}}
    return SeededModule(preset="tiny-qwen3", optimizer=sgd, warmup=0, min_lr_ratio=1.0)


# name: (strategy, its options); the datamodule cases train one epoch, the clipping cases one step.
DATAMODULE_CASES = {
    "context_parallel_ulysses": (ContextParallelStrategy, {"context_parallel_size": WORLD}),
    "context_parallel_ring": (ContextParallelStrategy, {"context_parallel_size": WORLD, "method": "ring"}),
}
CLIPPING_CASES = {
    "fsdp2": (FSDP2Strategy, {}),
    "fsdp2_cpu_offload": (FSDP2Strategy, {"cpu_offload": True}),
    "context_parallel_ulysses": (ContextParallelStrategy, {"context_parallel_size": WORLD}),
}


class RecordRun(Record):
    """Also keeps the weights the fit started from and every validation's metrics."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.start: dict[str, torch.Tensor] = {}
        self.validations: list[dict[str, float]] = []

    def on_train_start(self, trainer, pl_module) -> None:
        self.start = {name: whole_on_host(p) for name, p in pl_module.named_parameters()}

    def on_validation_end(self, trainer, pl_module) -> None:
        super().on_validation_end(trainer, pl_module)
        metrics = trainer.callback_metrics
        self.validations.append({name: float(value) for name, value in metrics.items() if name.startswith("val/")})

    def on_train_end(self, trainer, pl_module) -> None:
        super().on_train_end(trainer, pl_module)
        if trainer.is_global_zero:
            record = torch.load(self.path, weights_only=True)
            torch.save({**record, "start": self.start, "validations": self.validations}, self.path)


# What each kind of case trains: the datamodule cases an epoch of three steps at lr 0.1 (lr 1 would blow the loss
# up), validated after each step; the clipping cases one step at lr 1.
RUNS: dict[str, dict[str, Any]] = {
    "datamodule": {
        "max_epochs": 1, "accumulate_grad_batches": ACCUMULATE, "val_check_interval": VALIDATE_EVERY,
        "log_every_n_steps": ROWS // ACCUMULATE,  # tokens/s measured once, over the whole epoch
    },
    "clipping": {"max_steps": 1, "gradient_clip_val": CLIP},
}  # fmt: skip
LEARNING_RATES = {"datamodule": 0.1, "clipping": 1.0}


def _fit(kind: str, path: Path, datamodule: SFTDataModule, **options: Any) -> dict[str, Any]:
    trainer = Trainer(
        callbacks=[RecordRun(path)], logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, num_sanity_val_steps=0, accelerator="cpu", default_root_dir=path.parent,
        **RUNS[kind], **options,
    )  # fmt: skip
    trainer.fit(_module(LEARNING_RATES[kind]), datamodule=datamodule)
    return torch.load(path, weights_only=True) if trainer.is_global_zero else {}


def _worker(rank: int, out: Path) -> None:
    for kind, cases in (("datamodule", DATAMODULE_CASES), ("clipping", CLIPPING_CASES)):
        for name, (strategy, options) in cases.items():
            directory = out / kind / name
            directory.mkdir(parents=True, exist_ok=True)
            _fit(kind, directory / "ranks.pt", _datamodule(), devices=WORLD, strategy=strategy(**options))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("datamodule-and-clipping")
    run_on_gloo_ranks(_worker, (out,), world=WORLD, errors=out, timeout_s=LAUNCH_TIMEOUT_S)
    return out


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> Callable[[str, int], dict[str, Any]]:
    """What one process records on the rows a step of the two ranks trains on, in batches of ``batch_size`` rows:
    the same rows (context parallel: 1), or both ranks' rows of the step in one batch (FSDP2: 2, as its sampler
    gives rank 0 the first row of each pair and rank 1 the second). Each reference is run once."""

    @functools.cache
    def run(kind: str, batch_size: int) -> dict[str, Any]:
        directory = tmp_path_factory.mktemp(f"one-process-{kind}-{batch_size}")
        return _fit(kind, directory / "one_process.pt", _datamodule(batch_size), devices=1)

    return run


def _result(out: Path, kind: str, name: str) -> dict[str, Any]:
    return torch.load(out / kind / name / "ranks.pt", weights_only=True)


def _assert_same_change(got: dict[str, Any], changes: dict[str, torch.Tensor]) -> None:
    """Each weight moved from where the fit started by ``changes``, to 1e-4 of that tensor's largest change, plus
    the rounding of the weight itself (an fp32 weight of 1 holds a change of 1e-4 only to 6e-8)."""
    assert got["weights"].keys() == changes.keys()
    for name, change in changes.items():
        scale = change.abs().max().item()
        assert scale > 0, name
        rounding = torch.finfo(torch.float32).eps * got["start"][name].abs().max().item()
        change_got = got["weights"][name] - got["start"][name]
        torch.testing.assert_close(change_got, change, rtol=1e-4, atol=1e-4 * scale + rounding, msg=name)


def _assert_documents_cross_the_shard_boundaries(rows: list[dict[str, Any]], method: str) -> None:
    """What makes the data worth running: the rows whose length is no multiple of what ``method`` needs (the
    strategy pads them), and the rows with a document split between the ranks, counted."""
    lengths = [len(row["input_ids"]) for row in rows]
    padded_rows = sum(padded_length(length, WORLD, method) != length for length in lengths)
    split = 0
    for length, row in zip(lengths, rows):
        starts = torch.tensor([0, *row["seq_lengths"]]).cumsum(0).tolist()
        padded = padded_length(length, WORLD, method)
        cuts = {stop for rank in range(WORLD) for _, stop in rank_chunks(padded, WORLD, method, rank)} - {padded}
        split += any(start < cut < stop for cut in cuts for start, stop in zip(starts, starts[1:]))
    assert (padded_rows, split) == PADDED_AND_SPLIT_ROWS[method]


@pytest.mark.parametrize("name", list(DATAMODULE_CASES))
def test_a_context_parallel_group_fed_by_the_sft_datamodule_trains_and_validates_as_one_process(
    name, two_ranks, one_process
):
    datamodule = _datamodule()
    datamodule.setup("fit")
    rows = list(datamodule.train_dataset)
    assert (len(rows), len(datamodule.val_dataset)) == (ROWS, VALIDATION_ROWS)
    _assert_documents_cross_the_shard_boundaries(rows, DATAMODULE_CASES[name][1].get("method", "ulysses"))
    got = _result(two_ranks, "datamodule", name)
    expected = one_process("datamodule", 1)
    tokens = sum(len(row["input_ids"]) for row in rows)  # every real token of the epoch, once
    assert_tokens_trained(got, expected, tokens, WORLD)
    assert len(got["losses"]) == ROWS and got["losses"] == pytest.approx(expected["losses"], rel=1e-4)
    assert len(got["validations"]) == len(expected["validations"]) == ROWS // VALIDATE_EVERY
    for metrics, expected_metrics in zip(got["validations"], expected["validations"]):
        assert metrics.keys() == expected_metrics.keys() == {"val/loss", "val/ppl", "val/token_accuracy"}
        assert metrics == pytest.approx(expected_metrics, rel=1e-4)
    assert got["start"].keys() == expected["start"].keys()
    for key, value in expected["start"].items():
        torch.testing.assert_close(got["start"][key], value, rtol=0, atol=0, msg=key)
    _assert_same_change(got, {key: expected["weights"][key] - value for key, value in expected["start"].items()})


@pytest.mark.parametrize("name", list(CLIPPING_CASES))
def test_gradient_clipping_takes_the_norm_over_every_shard(name, two_ranks, one_process):
    got = _result(two_ranks, "clipping", name)
    strategy, _ = CLIPPING_CASES[name]
    batch_size = WORLD if strategy is FSDP2Strategy else 1  # FSDP2: each rank its own rows
    expected = one_process("clipping", batch_size)
    gradients = expected["gradients"]  # one process's, before clipping
    norm = torch.cat([gradient.reshape(-1) for gradient in gradients.values()]).norm().item()
    assert norm > 4 * CLIP, norm  # clipping binds
    assert_each_equal_up_to_rounding(got["gradients"], gradients, terms=TINY_MODEL_TERMS)  # recorded before clipping
    # SGD at lr 1: each weight moves by minus its gradient scaled to the clip norm (Lightning's 1e-6 is negligible).
    _assert_same_change(got, {key: -gradient * CLIP / (norm + 1e-6) for key, gradient in gradients.items()})
