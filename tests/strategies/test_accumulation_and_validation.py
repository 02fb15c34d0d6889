"""Gradient accumulation that changes during a fit, and validation metrics over all ranks, for both modules.

One process: under ``GradientAccumulationScheduler({0: 2})`` a fit trains as ``Trainer(accumulate_grad_batches=2)``
does, and under a schedule that changes at an epoch (``{0: 1, 1: 2}``, epochs of 3 micro-batches, so the last
step of the second epoch is shorter) each optimizer step trains on the step's mean loss, computed here by hand
from the weights the step started from: over the step's trainable tokens for SFT, the mean of its micro-batches'
means for DPO (TRL's convention). The first step of a loader of unknown length is read before the scheduler sets
the accumulation; a fit resumed in the middle of an epoch keeps it; an accumulation changed in a hook after a step
was read ahead is refused.

Two ranks (gloo): one launch of two forked processes runs every case in turn, each with its own Trainer: the
schedule under DDP and FSDP2 against one process whose micro-batches hold both ranks' rows, and each module's
validation metrics, read on every rank, against one process over the whole validation set: SFT, DPO, and GRPO and
RLOO, whose validation generates (greedily, so each rank draws what one process draws of the same prompts); and
validation rows that do not divide by the ranks, read through each module's datamodule (SFT, DPO, reward, GRPO):
the repeat that evens the ranks out counts in no metric.
"""

from __future__ import annotations

import functools
import os
import random
import time
import traceback
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import datasets
import pytest
import torch
import torch.multiprocessing as mp
from equivalence import TINY_MODEL_TERMS, assert_each_equal_up_to_rounding, assert_equal_up_to_rounding
from lightning.fabric.plugins.environments.lightning import find_free_network_port
from lightning.pytorch import Callback, LightningDataModule, LightningModule, Trainer
from lightning.pytorch.callbacks import GradientAccumulationScheduler, ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, IterableDataset

from lit_memtrain.datamodules.batch import IGNORE_INDEX, scored_rows, shift_targets
from lit_memtrain.datamodules.collate import PaddedCollator
from lit_memtrain.datamodules.embedded import make_preference
from lit_memtrain.datamodules.preference import PreferenceDataModule
from lit_memtrain.datamodules.prompts import PromptCollator, PromptDataModule
from lit_memtrain.datamodules.sft import SFTDataModule
from lit_memtrain.models.generation import SamplingSettings, TransformersGenerate
from lit_memtrain.objectives.causal_lm import CausalLMModule
from lit_memtrain.objectives.dpo import DPOModule
from lit_memtrain.objectives.grpo import GRPOModule
from lit_memtrain.objectives.reward import RewardModule
from lit_memtrain.objectives.rloo import RLOOModule
from lit_memtrain.strategies import FSDP2Strategy

WORLD = 2
EPOCH_BATCHES = 3
SCHEDULE = {0: 1, 1: 2}
SCHEDULE_STEPS = [[0], [1], [2], [0, 1], [2]]  # the epoch's micro-batches each optimizer step trains on
LAUNCH_TIMEOUT_S = 300
SGD = {"optimizer": {"class_path": "torch.optim.SGD", "init_args": {"lr": 0.5}}, "warmup": 0, "min_lr_ratio": 1.0}


class SeededSFT(CausalLMModule):
    def configure_model(self) -> None:
        if self.model is None:  # the same weights wherever the model is built (each rank, the reference)
            torch.manual_seed(0)
        super().configure_model()


class SeededDPO(DPOModule):
    def configure_model(self) -> None:
        if self.model is None:
            torch.manual_seed(0)
        super().configure_model()


class SeededReward(RewardModule):
    def configure_model(self) -> None:
        if self.model is None:
            torch.manual_seed(0)
        super().configure_model()


class SeededGRPO(GRPOModule):
    def configure_model(self) -> None:
        if self.model is None:
            torch.manual_seed(0)
        super().configure_model()


class SeededRLOO(RLOOModule):
    def configure_model(self) -> None:
        if self.model is None:
            torch.manual_seed(0)
        super().configure_model()


MAX_COMPLETION = 5
GREEDY = SamplingSettings(max_completion_length=MAX_COMPLETION, do_sample=False)


class CutGreedy(TransformersGenerate):
    """Greedy completions (the same on whichever rank they are drawn) cut to a length set by the prompt's length, so
    that the mean completion length of each rank's prompts differs from that of the whole set."""

    def generate(self, model, prompt_ids, num_generations, device, weights_version):
        completions = super().generate(model, prompt_ids, num_generations, device, weights_version)
        return [c[: 1 + len(prompt_ids[i // num_generations]) % MAX_COMPLETION] for i, c in enumerate(completions)]


def _score(completions, score, **kwargs):
    """The prompt's own score: rank 0's prompts score low, rank 1's high."""
    return [float(s) for s in score]


def _length(completion_ids, scored, **kwargs):
    """The completion's length, where the prompt is scored (None, NaN, elsewhere: left out of the means)."""
    return [float(len(ids)) if s else None for ids, s in zip(completion_ids, scored)]


def _rl_module(kind: str) -> GRPOModule:
    cls, options = (SeededGRPO, {}) if kind == "grpo" else (SeededRLOO, {"beta": 0.0})
    return cls(
        preset="tiny-qwen3", tokenizer="lit-memtrain/embedded", reward_funcs=[_score, _length],
        reward_weights=[1.0, 0.5], num_generations=2, max_completion_length=MAX_COMPLETION, do_sample=False,
        generation_backend=CutGreedy(GREEDY, [2], pad_token_id=0), **options,
        config_overrides={"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "head_dim": 16},
    )  # fmt: skip


def _module(kind: str) -> LightningModule:
    if kind == "sft":
        return SeededSFT(preset="tiny-qwen3", **SGD)
    if kind in ("grpo", "rloo"):
        return _rl_module(kind)
    if kind == "reward":
        return SeededReward(preset="tiny-qwen3", tokenizer="lit-memtrain/embedded", **SGD)
    return SeededDPO(preset="tiny-qwen3", tokenizer="lit-memtrain/embedded", **SGD)


def _sft_rows(rank: int, index: int) -> list[dict[str, list[int]]]:
    """Two rows of different lengths; rank 0 trains on many more targets than rank 1, and each batch on its own
    number, so that only the mean over a step's tokens (not a mean of batch means) matches."""
    generator = torch.Generator().manual_seed(100 * rank + index)
    rows = []
    for row in range(2):
        ids = torch.randint(1, 512, (12 + 2 * index + row,), generator=generator).tolist()
        masked = (2 if rank == 0 else 9) + index
        rows.append({"input_ids": ids, "labels": [-100] * masked + ids[masked:]})
    return rows


@functools.cache
def _preference_data() -> tuple[list[dict[str, Any]], Any]:
    """Tokenized preference pairs, each with its own reference log-probabilities, and their collator."""
    data = datasets.Dataset.from_list([make_preference(random.Random(i)) for i in range(16)])
    datamodule = PreferenceDataModule(dataset=data, max_length=128)
    datamodule.setup("fit")
    train = datamodule.datasets["train"]
    assert len(train) == 16
    pairs = [{**train[i], "ref_chosen_logps": -30.0 + i, "ref_rejected_logps": -25.0 - 0.5 * i} for i in range(16)]
    return pairs, datamodule.collator()


def _dpo_batch(indices: list[int]) -> dict[str, Any]:
    pairs, collate = _preference_data()
    return collate([pairs[i] for i in indices])


def _train_batches(kind: str, ranks: list[int]) -> list[dict[str, Any]]:
    """An epoch of micro-batches holding the rows of ``ranks`` (one rank's, or all of them for the reference)."""
    if kind == "sft":
        collate = PaddedCollator(pad_token_id=0)
        return [collate([row for rank in ranks for row in _sft_rows(rank, i)]) for i in range(EPOCH_BATCHES)]
    return [_dpo_batch([rank * EPOCH_BATCHES + i for rank in ranks]) for i in range(EPOCH_BATCHES)]


VALIDATION_PAIRS = {0: [[6], [7]], 1: [[8, 9, 10], [11, 12, 13]]}


VALIDATION_PROMPTS = {0: [1, 2], 1: [3, 1]}  # prompts per batch: 3 on rank 0, 4 on rank 1, in batches of unequal size


def _prompt_batch(rank: int, batch: int) -> dict[str, Any]:
    """Prompts of different lengths (so of different completion lengths), with the columns the rewards read."""
    generator = torch.Generator().manual_seed(1000 + 10 * rank + batch)
    rows = []
    for row in range(VALIDATION_PROMPTS[rank][batch]):
        ids = torch.randint(3, 384, (4 + 3 * rank + 2 * batch + row,), generator=generator).tolist()
        rows.append({"prompt": f"rank {rank} batch {batch} row {row}", "prompt_ids": ids,
                     "score": 10 * rank + batch + row, "scored": row != 1})  # fmt: skip
    return PromptCollator(["score", "scored"])(rows)


def _validation_batches(kind: str, rank: int) -> list[dict[str, Any]]:
    """Two batches a rank: rank 1's hold three times the rows (pairs) of rank 0's, so only a mean weighted by tokens
    (pairs) over both ranks matches the whole set; for GRPO and RLOO, 3 and 4 prompts in batches of unequal size."""
    if kind == "sft":
        return [PaddedCollator(pad_token_id=0)(_sft_rows(rank, 10 + i) * (1 + 2 * rank)) for i in range(2)]
    if kind in ("grpo", "rloo"):
        return [_prompt_batch(rank, batch) for batch in range(len(VALIDATION_PROMPTS[rank]))]
    return [_dpo_batch(indices) for indices in VALIDATION_PAIRS[rank]]


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().cpu().clone()


class Steps(Callback):
    """Each optimizer step: the weights it started from, its micro-batches and the gradients it stepped with."""

    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._open is None:
            self._open = {"weights": {n: _full(p) for n, p in pl_module.named_parameters()}, "batches": []}
        self._open["batches"].append(batch)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        gradients = {n: _full(p.grad) for n, p in pl_module.named_parameters() if p.grad is not None}
        self.steps.append({**self._open, "gradients": gradients})
        self._open = None

    def summary(self, module: LightningModule) -> dict[str, Any]:
        return {
            "windows": [len(step["batches"]) for step in self.steps],
            "starts": [step["weights"] for step in self.steps],
            "gradients": [step["gradients"] for step in self.steps],
            "weights": {n: _full(p) for n, p in module.named_parameters()},
        }


def _trainer(callbacks: list[Callback], **options: Any) -> Trainer:
    defaults = {"logger": False, "enable_progress_bar": False, "enable_model_summary": False,
                "enable_checkpointing": False, "num_sanity_val_steps": 0, "accelerator": "cpu"}  # fmt: skip
    return Trainer(callbacks=callbacks, **{**defaults, **options})


class Stream(IterableDataset):
    """Batches of unknown number: Lightning fetches the first one before ``on_train_epoch_start``."""

    def __init__(self, batches: list[dict[str, Any]]) -> None:
        self.batches = batches

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.batches)


def _fit(
    kind: str, batches: list[dict[str, Any]], epochs: int, stream: bool = False, ckpt_path: Path | None = None,
    **options: Any,
) -> tuple[LightningModule, Steps]:
    module, steps = _module(kind), Steps()
    callbacks = [steps, *options.pop("callbacks", [])]
    loader = DataLoader(Stream(batches) if stream else batches, batch_size=None)
    _trainer(callbacks, max_epochs=epochs, **options).fit(module, loader, ckpt_path=ckpt_path)
    return module, steps


def _assert_same(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert_each_equal_up_to_rounding(actual, expected, terms=TINY_MODEL_TERMS)  # SGD's weights: at their own scale


def _by_hand(
    module: LightningModule, kind: str, weights: dict[str, torch.Tensor], batches: list[dict[str, Any]]
) -> dict[str, torch.Tensor]:
    """The gradients of the mean loss of a step's ``batches`` at the ``weights`` the step started from."""
    module.train()
    with torch.no_grad():
        for name, parameter in module.named_parameters():
            parameter.copy_(weights[name])
            parameter.grad = None
    if kind == "sft":
        tokens = sum(int((shift_targets(b["labels"]) != IGNORE_INDEX).sum()) for b in batches)
        loss = sum(module.compute_loss(b, num_items=tokens) for b in batches)
    else:
        loss = sum(module.pair_loss(b)[0] for b in batches) / len(batches)
    loss.backward()
    return {n: p.grad for n, p in module.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", ["sft", "dpo"])
def test_a_scheduled_accumulation_trains_as_the_fixed_one(kind):
    # Batches of unknown number: the first step is read ahead before the scheduler sets the accumulation.
    batches = _train_batches(kind, [0, 1])
    scheduled = _fit(kind, batches, 1, stream=True, callbacks=[GradientAccumulationScheduler({0: 2})])
    fixed = _fit(kind, batches, 1, stream=True, accumulate_grad_batches=2)
    (scheduled_module, scheduled_steps), (fixed_module, fixed_steps) = scheduled, fixed
    got, expected = scheduled_steps.summary(scheduled_module), fixed_steps.summary(fixed_module)
    assert got["windows"] == expected["windows"] == [2, 1]
    for gradients, expected_gradients in zip(got["gradients"], expected["gradients"]):
        _assert_same(gradients, expected_gradients)
    _assert_same(got["weights"], expected["weights"])


@pytest.mark.parametrize("kind", ["sft", "dpo"])
def test_each_step_of_a_schedule_that_changes_at_an_epoch_trains_on_its_own_mean(kind):
    module, steps = _fit(kind, _train_batches(kind, [0, 1]), 2, callbacks=[GradientAccumulationScheduler(SCHEDULE)])
    assert [len(step["batches"]) for step in steps.steps] == [len(step) for step in SCHEDULE_STEPS]
    for step in steps.steps:
        _assert_same(step["gradients"], _by_hand(module, kind, step["weights"], step["batches"]))


def test_a_fit_resumed_in_the_middle_of_an_epoch_keeps_the_scheduled_accumulation(tmp_path):
    """Lightning skips on_train_epoch_start, where the scheduler sets the accumulation, in an epoch it resumes in
    the middle of: the resumed fit still trains two micro-batches a step, on their mean."""
    batches = _train_batches("sft", [0]) + _train_batches("sft", [1])[:1]  # steps of batches [0, 1] and [2, 3]
    save = ModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=1)
    scheduler = GradientAccumulationScheduler({0: 2})
    _fit("sft", batches, 1, max_steps=1, enable_checkpointing=True, callbacks=[save, scheduler])
    module, steps = _fit("sft", batches, 1, ckpt_path=tmp_path / "step=1.ckpt", callbacks=[scheduler])
    assert [len(step["batches"]) for step in steps.steps] == [2]
    step = steps.steps[0]
    _assert_same(step["gradients"], _by_hand(module, "sft", step["weights"], step["batches"]))


class SetsAccumulationAtEpochStart(Callback):
    def on_train_epoch_start(self, trainer, pl_module) -> None:
        trainer.accumulate_grad_batches = 2


@pytest.mark.parametrize("kind", ["sft", "dpo"])
def test_a_step_read_ahead_for_another_accumulation_is_refused(kind):
    # Only a GradientAccumulationScheduler's value is known before the epoch starts, when the first step is read.
    with pytest.raises(RuntimeError, match="read ahead for accumulate_grad_batches=1, but 2 is in force"):
        _fit(kind, _train_batches(kind, [0]), 1, stream=True, callbacks=[SetsAccumulationAtEpochStart()])


# ------------------------------------------------------------------------------------------------- two ranks

FIT_CASES = [("sft", "ddp"), ("sft", "fsdp2"), ("dpo", "ddp"), ("dpo", "fsdp2")]
VALIDATION_CASES = [("sft", "ddp"), ("dpo", "fsdp2"), ("grpo", "ddp"), ("rloo", "fsdp2")]
DATAMODULE_VALIDATION_CASES = [
    ("sft", "fsdp2"), ("sft-stream", "fsdp2"), ("dpo", "fsdp2"), ("reward", "ddp"), ("grpo", "ddp"),
]  # fmt: skip


def _strategy(name: str) -> Any:
    return DDPStrategy() if name == "ddp" else FSDP2Strategy()


def _run_fit_case(kind: str, strategy: str, rank: int, out: Path) -> None:
    scheduler = GradientAccumulationScheduler(SCHEDULE)
    module, steps = _fit(
        kind, _train_batches(kind, [rank]), 2, callbacks=[scheduler], devices=WORLD, strategy=_strategy(strategy),
        use_distributed_sampler=False,
    )  # fmt: skip
    summary = steps.summary(module)
    if rank == 0:
        torch.save(summary, out / f"fit-{kind}-{strategy}.pt")


def _run_validation_case(kind: str, strategy: str, rank: int, out: Path) -> None:
    trainer = _trainer([], devices=WORLD, strategy=_strategy(strategy), use_distributed_sampler=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.validate(_module(kind), DataLoader(_validation_batches(kind, rank), batch_size=None), verbose=False)
    metrics = {name: float(value) for name, value in trainer.callback_metrics.items()}
    torch.save({"metrics": metrics, "warnings": [str(w.message) for w in caught]}, out / f"val-{kind}-{rank}.pt")


def _datamodule(kind: str) -> LightningDataModule:
    """Validation rows that do not divide by two ranks, read through the module's datamodule: 7 SFT rows of
    different lengths (5 streamed), 7 preference pairs (with their reference log-probabilities), 5 prompts whose
    scores differ."""
    if kind.startswith("sft"):
        rows = [{"prompt": f"Question {i}:" + " and" * i, "completion": " the answer" + " is here" * (3 * i + 1)}
                for i in range(14)]  # fmt: skip
        data = datasets.Dataset.from_list(rows)
        if kind == "sft-stream":  # the first 5 rows, one a batch: 3 batches on one rank, 2 on the other if read apart
            stream = data.to_iterable_dataset()
            return SFTDataModule(tokenizer="lit-memtrain/embedded", dataset=stream, streaming=True, val_size=5,
                                 val_batch_size=1)  # fmt: skip
        return SFTDataModule(tokenizer="lit-memtrain/embedded", dataset=data, val_size=0.5, val_batch_size=2)
    if kind in ("dpo", "reward"):
        rows = [{**make_preference(random.Random(i)), "ref_chosen_logps": -30.0 + i, "ref_rejected_logps": -25.0 - i}
                for i in range(10)]  # fmt: skip
        data = datasets.Dataset.from_list(rows)
        long_pairs = "drop" if kind == "reward" else "truncate"  # a reward model reads its score at the end
        return PreferenceDataModule(dataset=data, max_length=128, long_pairs=long_pairs, val_size=7, val_batch_size=2)
    rows = [{"prompt": f"Prompt {i}:" + " and" * i, "score": float(i * i), "scored": i % 3 != 1} for i in range(8)]
    data = datasets.Dataset.from_list(rows)
    return PromptDataModule(tokenizer="lit-memtrain/embedded", dataset=data, val_size=5, val_batch_size=2)


class ScoredRows(Callback):
    """This rank's validation batches, and what they give the metrics: SFT targets (labels not ``IGNORE_INDEX``),
    pairs or prompts (but those a batch marks as not scored)."""

    def __init__(self) -> None:
        self.count = 0
        self.batches = 0

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self.batches += 1
        if "labels" in batch and "num_pairs" not in batch:
            self.count += int((batch["labels"] != IGNORE_INDEX).sum())
        else:
            rows = int(batch["num_pairs"]) if "num_pairs" in batch else len(batch["prompt_ids"])
            self.count += int(scored_rows(batch, rows).sum())


def _run_datamodule_validation_case(kind: str, strategy: str, rank: int, out: Path) -> None:
    scored = ScoredRows()
    trainer = _trainer([scored], devices=WORLD, strategy=_strategy(strategy))
    trainer.validate(_module(kind.removesuffix("-stream")), datamodule=_datamodule(kind), verbose=False)
    metrics = {name: float(value) for name, value in trainer.callback_metrics.items()}
    result = {"metrics": metrics, "batches": scored.batches, "scored": scored.count}
    torch.save(result, out / f"val-datamodule-{kind}-{rank}.pt")


def _worker(rank: int, out: Path, port: int) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(WORLD),
                       "NODE_RANK": "0", "LOCAL_RANK": str(rank)})  # fmt: skip
    torch.set_num_threads(1)
    cases = [(f"fit-{k}-{s}", _run_fit_case, k, s) for k, s in FIT_CASES]
    cases += [(f"val-{k}", _run_validation_case, k, s) for k, s in VALIDATION_CASES]
    cases += [(f"val-datamodule-{k}", _run_datamodule_validation_case, k, s) for k, s in DATAMODULE_VALIDATION_CASES]
    for name, run, kind, strategy in cases:
        try:
            run(kind, strategy, rank, out)
        except Exception:  # noqa: BLE001 - reported by the test of that case
            (out / f"{name}.rank{rank}.error").write_text(traceback.format_exc())
            raise


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> Path:
    """Every two-rank case, in one launch of two forked processes."""
    out = tmp_path_factory.mktemp("two-ranks")
    _preference_data()  # tokenized once, before the fork
    context = mp.start_processes(
        _worker, args=(out, find_free_network_port()), nprocs=WORLD, join=False, start_method="fork"
    )
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    try:
        while not context.join(timeout=max(1.0, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the two processes did not finish within {LAUNCH_TIMEOUT_S} s")
    except Exception:
        for process in context.processes:
            if process.is_alive():
                process.kill()
        if not list(out.glob("*.error")):
            raise
    return out


def _result(out: Path, name: str) -> dict[str, Any]:
    for error in sorted(out.glob(f"{name}.rank*.error")):
        pytest.fail(f"the two-rank run {name} failed on {error.stem}:\n{error.read_text()}")
    return torch.load(out / f"{name}.pt", weights_only=True)


@pytest.mark.parametrize(("kind", "strategy"), FIT_CASES)
def test_two_ranks_under_a_schedule_train_each_step_on_the_mean_over_both(kind, strategy, two_ranks):
    """Each step's gradients are those one process computes, from the weights the step started from, on the
    step's micro-batches with both ranks' rows."""
    distributed = _result(two_ranks, f"fit-{kind}-{strategy}")
    assert distributed["windows"] == [len(step) for step in SCHEDULE_STEPS]
    module, batches = _module(kind), _train_batches(kind, [0, 1])
    module.configure_model()
    for weights, gradients, step in zip(distributed["starts"], distributed["gradients"], SCHEDULE_STEPS):
        _assert_same(gradients, _by_hand(module, kind, weights, [batches[i] for i in step]))


@pytest.mark.parametrize("kind", ["sft", "dpo"])
def test_validation_metrics_on_every_rank_are_those_of_the_whole_set(kind, two_ranks):
    _assert_validation_metrics_of_the_whole_set(kind, two_ranks)


@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_rl_validation_metrics_on_every_rank_are_those_of_the_whole_set(kind, two_ranks):
    """Each rank generates greedily for its own prompts (3 and 4, in batches of 1 and 2, 3 and 1): the rewards and
    completion lengths logged on every rank are those of one process over all 7 prompts, not of the rank's own."""
    expected = _assert_validation_metrics_of_the_whole_set(kind, two_ranks)
    scores = [[s for batch in _validation_batches(kind, rank) for s in batch["columns"]["score"]] for rank in (0, 1)]
    whole = sum(scores[0] + scores[1]) / len(scores[0] + scores[1])
    terms = len(scores[0] + scores[1])
    assert_equal_up_to_rounding(expected["val/rewards/_score/mean"], whole, name="score", terms=terms)
    for own in scores:  # a rank's own mean is far from the whole set's: the comparison above can fail
        assert abs(sum(own) / len(own) - whole) > 1


_RL_METRICS = {"reward", "completions/mean_length", "rewards/_score/mean", "rewards/_length/mean"}
VALIDATION_METRICS = {
    "sft": {"loss", "ppl", "token_accuracy"},
    "dpo": {"loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
            "logps/rejected"},
    "reward": {"loss", "accuracy", "margin", "rewards/chosen", "rewards/rejected", "mean_reward", "min_reward",
               "max_reward"},
    "grpo": _RL_METRICS,
    "rloo": _RL_METRICS,
}  # fmt: skip


def _assert_validation_metrics_of_the_whole_set(kind: str, two_ranks: Path) -> dict[str, float]:
    for error in sorted(two_ranks.glob(f"val-{kind}.rank*.error")):
        pytest.fail(f"the two-rank validation of {kind} failed on {error.stem}:\n{error.read_text()}")
    batches = [batch for rank in range(WORLD) for batch in _validation_batches(kind, rank)]
    trainer = _trainer([], devices=1)
    expected = trainer.validate(_module(kind), DataLoader(batches, batch_size=None), verbose=False)[0]
    assert set(expected) == {f"val/{name}" for name in VALIDATION_METRICS[kind]}
    for rank in range(WORLD):
        got = torch.load(two_ranks / f"val-{kind}-{rank}.pt", weights_only=True)
        assert got["metrics"].keys() == expected.keys()
        for name, value in expected.items():
            named = f"rank {rank}: {name}"
            assert_equal_up_to_rounding(got["metrics"][name], value, name=named, terms=TINY_MODEL_TERMS)
        assert not [message for message in got["warnings"] if "sync_dist" in message]
    return expected


# Each kind's validation batches on one process and on each of two ranks (one rank's last row a repeat that evens
# them out), and what the metrics count: SFT's targets, pairs, prompts.
DATAMODULE_VALIDATION = {
    "sft": (4, 2, 665), "sft-stream": (5, 3, 175), "dpo": (4, 2, 7), "reward": (4, 2, 7), "grpo": (3, 2, 5),
}  # fmt: skip


@pytest.mark.parametrize(("kind", "strategy"), DATAMODULE_VALIDATION_CASES)
def test_validation_through_the_datamodule_scores_each_row_once(kind, strategy, two_ranks):
    """Validation rows that do not divide by two ranks, dealt by the module's datamodule: each rank runs as many
    batches, one rank's last row a repeat that evens them out and counts in no metric, and the metrics on every
    rank are those of one process over the whole set. Lightning's own sampler would score the first row twice
    (SFT: 748 targets for 665)."""
    for error in sorted(two_ranks.glob(f"val-datamodule-{kind}.rank*.error")):
        pytest.fail(f"the two-rank validation through the datamodule failed on {error.stem}:\n{error.read_text()}")
    batches, rank_batches, targets = DATAMODULE_VALIDATION[kind]
    scored = ScoredRows()
    trainer = _trainer([scored], devices=1)
    expected = trainer.validate(_module(kind.removesuffix("-stream")), datamodule=_datamodule(kind), verbose=False)[0]
    assert (scored.batches, scored.count) == (batches, targets)
    assert set(expected) == {f"val/{name}" for name in VALIDATION_METRICS[kind.removesuffix("-stream")]}
    ranks = [torch.load(two_ranks / f"val-datamodule-{kind}-{rank}.pt", weights_only=True) for rank in range(WORLD)]
    assert sum(got["scored"] for got in ranks) == targets  # every target once, none twice
    for rank, got in enumerate(ranks):
        assert got["batches"] == rank_batches
        for name, value in expected.items():
            named = f"rank {rank}: {name}"
            assert_equal_up_to_rounding(got["metrics"][name], value, name=named, terms=TINY_MODEL_TERMS)
