"""Exact resume (issue 13, point 4): a run stopped after N steps and resumed from its checkpoint trains on the
batches an uninterrupted run would have, at steps N+1..N+5, for in-memory and streamed data, one process
and two (DDP), and on the path where Lightning builds the dataloader before restoring (Lightning #20550).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import datasets
import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import SingleDeviceStrategy

from lit_memtrain.datamodules.resumable import ResumableDataLoader, ResumableSampler
from lit_memtrain.datamodules.sft import SFTDataModule

STOP = 9  # mid-epoch: in memory an epoch is 7 batches, so the resumed steps cross into a third epoch
RESUMED = range(STOP + 1, STOP + 6)


def fingerprint(batch: dict) -> str:
    data = batch["input_ids"].numpy().tobytes() + batch["labels"].numpy().tobytes()
    return hashlib.sha1(data).hexdigest()[:16]


class BatchRecorder(LightningModule):
    """Records a fingerprint of the batch of each step (one trained scalar, so steps are real)."""

    def __init__(self, out: str | None = None) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(()))
        self.out = out
        self.fingerprints: dict[int, str] = {}

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        self.fingerprints[self.global_step + 1] = fingerprint(batch)
        return self.weight * batch["input_ids"].float().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        self.trainer.estimated_stepping_batches  # as CausalLMModule does: with max_epochs set, this builds the loader
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def on_train_end(self) -> None:
        if self.out:
            Path(self.out.format(rank=self.global_rank)).write_text(json.dumps(self.fingerprints))


class RestoreAfterSetup(SingleDeviceStrategy):
    """Restores checkpoints after its setup, as FSDP and ModelParallelStrategy do."""

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True


def text_corpus(path: Path, count: int = 26) -> Path:
    rows = [{"text": f"example {i} " + "word " * (i % 11 + 2)} for i in range(count)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def datamodule(corpus: Path, streaming: bool) -> SFTDataModule:
    if streaming:  # packed rows of 32 tokens, a window of 8 examples: the stream repeats several times
        return SFTDataModule(dataset=str(corpus), max_length=32, batch_size=2, streaming=True, buffer_size=8,
                             packing=True, packing_strategy="bfd_split")
    return SFTDataModule(dataset=str(corpus), max_length=32, batch_size=4)


def fit(tmp_path, corpus, streaming, max_steps, ckpt_path=None, checkpoint_every=None, strategy="auto",
        devices=1, max_epochs=None, module=None, accumulate_grad_batches=1, limit_train_batches=None):
    callbacks = []
    if checkpoint_every:
        callbacks.append(ModelCheckpoint(tmp_path / "ckpt", "{step}", every_n_train_steps=checkpoint_every, save_top_k=-1))
    module = module or BatchRecorder(str(tmp_path / f"steps-{max_steps}-{ckpt_path is not None}-{{rank}}.json"))
    trainer = Trainer(
        max_steps=max_steps, max_epochs=max_epochs, accelerator="cpu", devices=devices, strategy=strategy,
        logger=False, enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
        enable_checkpointing=bool(callbacks), limit_val_batches=0, num_sanity_val_steps=0, default_root_dir=tmp_path,
        accumulate_grad_batches=accumulate_grad_batches, limit_train_batches=limit_train_batches,
    )
    trainer.fit(module, datamodule=datamodule(corpus, streaming), ckpt_path=ckpt_path)
    return module


def recorded(tmp_path, max_steps, resumed, rank=0):
    path = tmp_path / f"steps-{max_steps}-{resumed}-{rank}.json"
    return {int(step): value for step, value in json.loads(path.read_text()).items()}


@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize("setup", ["default", "max_epochs", "restore_after_setup"])
def test_a_resumed_run_trains_on_the_batches_of_an_uninterrupted_one(tmp_path, streaming, setup):
    corpus = text_corpus(tmp_path / "corpus.jsonl")
    options = {
        "default": {},
        "max_epochs": {"max_epochs": 100},  # estimated_stepping_batches builds the loader before the restore
        "restore_after_setup": {"max_epochs": 100, "strategy": RestoreAfterSetup(torch.device("cpu"))},
    }[setup]
    fit(tmp_path, corpus, streaming, STOP + 5, checkpoint_every=STOP, **options)
    reference = recorded(tmp_path, STOP + 5, False)
    checkpoint = tmp_path / "ckpt" / f"step={STOP}.ckpt"
    if setup == "restore_after_setup":
        options["strategy"] = RestoreAfterSetup(torch.device("cpu"))
    fit(tmp_path, corpus, streaming, STOP + 5, ckpt_path=checkpoint, **options)
    resumed = recorded(tmp_path, STOP + 5, True)
    assert sorted(resumed) == list(RESUMED)
    assert [resumed[step] for step in RESUMED] == [reference[step] for step in RESUMED]
    assert len(set(reference.values())) > 7  # the batches differ from step to step


@pytest.mark.parametrize("streaming", [False, True])
def test_epochs_cut_by_limit_train_batches_resume_and_a_stream_goes_on(tmp_path, streaming):
    """An epoch of 4 batches (limit_train_batches), a checkpoint after its last one: the resumed run starts the
    next epoch, as the uninterrupted one does; and a stream's next epoch continues it (its first rows once)."""
    corpus = text_corpus(tmp_path / "corpus.jsonl", count=120)  # a pass of the stream is longer than 3 epochs
    fit(tmp_path, corpus, streaming, 12, checkpoint_every=4, limit_train_batches=4)
    reference = recorded(tmp_path, 12, False)
    fit(tmp_path, corpus, streaming, 12, ckpt_path=tmp_path / "ckpt" / "step=4.ckpt", limit_train_batches=4)
    resumed = recorded(tmp_path, 12, True)
    assert sorted(resumed) == list(range(5, 13))
    assert [resumed[step] for step in range(5, 13)] == [reference[step] for step in range(5, 13)]
    assert len(set(reference.values())) == 12  # no epoch trains on an earlier epoch's batches


@pytest.mark.parametrize("streaming", [False, True])
def test_a_resumed_ddp_run_trains_each_rank_on_its_own_batches(tmp_path, streaming):
    corpus = text_corpus(tmp_path / "corpus.jsonl", count=52)
    fit(tmp_path, corpus, streaming, STOP + 5, checkpoint_every=STOP, strategy="ddp_fork", devices=2)
    checkpoint = tmp_path / "ckpt" / f"step={STOP}.ckpt"
    fit(tmp_path, corpus, streaming, STOP + 5, ckpt_path=checkpoint, strategy="ddp_fork", devices=2)
    reference = [recorded(tmp_path, STOP + 5, False, rank) for rank in (0, 1)]
    resumed = [recorded(tmp_path, STOP + 5, True, rank) for rank in (0, 1)]
    for rank in (0, 1):
        assert [resumed[rank][step] for step in RESUMED] == [reference[rank][step] for step in RESUMED]
    assert not set(reference[0].values()) & set(reference[1].values())  # each rank reads its own share


@pytest.mark.parametrize(("streaming", "accumulate"), [(False, 1), (True, 2), (False, 2)])
def test_the_causal_lm_module_resumes_on_the_same_batches(tmp_path, streaming, accumulate):
    """Also with gradient accumulation, where the module reads each optimizer step's micro-batches ahead to
    count its tokens (lit_memtrain.objectives.step_tokens): every micro-batch of steps N+1..N+5 is the same."""
    from lit_memtrain.objectives.causal_lm import CausalLMModule

    class Recording(CausalLMModule):
        def on_train_batch_start(self, batch, batch_idx):
            super().on_train_batch_start(batch, batch_idx)
            self.fingerprints.setdefault(self.global_step + 1, []).append(fingerprint(batch))

    def module():
        torch.manual_seed(0)
        recording = Recording(preset="tiny-qwen3", tokenizer="lit-memtrain/embedded")
        recording.fingerprints = {}
        return recording

    corpus = text_corpus(tmp_path / "corpus.jsonl")
    options = {"accumulate_grad_batches": accumulate}
    reference = fit(tmp_path, corpus, streaming, STOP + 5, checkpoint_every=STOP, module=module(), **options)
    resumed = fit(tmp_path, corpus, streaming, STOP + 5, ckpt_path=tmp_path / "ckpt" / f"step={STOP}.ckpt",
                  module=module(), **options)
    assert sorted(resumed.fingerprints) == list(RESUMED)
    assert max(len(resumed.fingerprints[step]) for step in RESUMED) == accumulate  # an epoch's last step may be short
    assert [resumed.fingerprints[step] for step in RESUMED] == [reference.fingerprints[step] for step in RESUMED]


def test_the_loader_state_is_the_position_after_the_batches_trained_on():
    data = datasets.Dataset.from_dict({"input_ids": [[i] for i in range(10)]})
    loader = ResumableDataLoader(data, batch_size=3, sampler=ResumableSampler(data, seed=1), collate_fn=lambda rows: rows)
    epoch = [batch for batch in loader]
    iterator = iter(loader)
    next(iterator)
    state = loader.state_dict()
    assert state == {"epoch": 0, "batches": 1, "replicas": 1, "batch_size": 3, "rows": 10, "seed": 1}
    resumed = ResumableDataLoader(data, batch_size=3, sampler=ResumableSampler(data, seed=1), collate_fn=lambda rows: rows)
    resumed.load_state_dict(state)
    assert [batch for batch in resumed] == epoch[1:] and len(resumed) == 4
    list(iterator)
    assert loader.state_dict() == {"epoch": 1, "batches": 0}  # a finished epoch resumes at the next one
    loader.load_state_dict({"epoch": 1, "batches": 0})
    assert [batch for batch in loader] != epoch  # each epoch has its own order
    with pytest.raises(ValueError, match="saved for a stream"):
        loader.load_state_dict({"epoch": 0, "batches": 1, "stream": None})


@pytest.mark.parametrize(
    ("streaming", "change", "value"),
    [(False, "seed", 7), (True, "batch_size", 3), (True, "max_length", 40), (True, "buffer_size", 5),
     (True, "seed", 7)],  # fmt: skip
)
def test_a_position_in_rows_laid_out_otherwise_is_refused(tmp_path, streaming, change, value):
    """A position counts batches over rows in one order: under another seed, or a stream cut, packed or batched
    otherwise, it would point at other examples (some skipped, some repeated), so it is not resumed there."""
    corpus = text_corpus(tmp_path / "corpus.jsonl")
    data = datamodule(corpus, streaming)
    data.setup("fit")
    loader = data.train_dataloader()
    iterator = iter(loader)
    next(iterator), next(iterator)
    state = loader.state_dict()
    same = datamodule(corpus, streaming)
    same.setup("fit")
    same.load_state_dict({"train_loader": state})
    assert next(iter(same.train_dataloader()))["input_ids"].tolist() == next(iterator)["input_ids"].tolist()
    other = datamodule(corpus, streaming)
    setattr(other, change, value)
    other.setup("fit")
    other.load_state_dict({"train_loader": state})
    with pytest.raises(ValueError, match=rf"laid out otherwise \({change}=\d+ then, {value} now\): resuming from it"):
        other.train_dataloader()


def test_a_map_style_position_over_another_number_of_rows_is_refused():
    data = datasets.Dataset.from_dict({"input_ids": [[i] for i in range(12)]})
    trained = ResumableDataLoader(data, batch_size=3, sampler=ResumableSampler(data, seed=1), collate_fn=lambda r: r)
    next(iter(trained))
    fewer = data.select(range(10))  # e.g. packed at another max_length, or tokenized by another version
    resumed = ResumableDataLoader(fewer, batch_size=3, sampler=ResumableSampler(fewer, seed=1), collate_fn=lambda r: r)
    with pytest.raises(ValueError, match=r"\(rows=12 then, 10 now\)"):
        resumed.load_state_dict(trained.state_dict())
    resumed.load_state_dict({"epoch": 1, "batches": 0})  # an epoch's end: nothing to skip
    assert len(list(resumed)) == 4


def test_worker_processes_start_at_the_resumed_batch():
    data = datasets.Dataset.from_dict({"input_ids": [[i] for i in range(10)]})

    def loader():
        sampler = ResumableSampler(data, seed=1)
        return ResumableDataLoader(data, batch_size=3, sampler=sampler, collate_fn=lambda rows: rows,
                                   num_workers=1, persistent_workers=True)

    epoch = list(loader())
    resumed = loader()
    resumed.load_state_dict({"epoch": 0, "batches": 2})
    assert list(resumed) == epoch[2:]
    assert list(resumed) == epoch  # the skip applies once: the next iteration (same workers) starts at the top


def test_a_mid_epoch_position_of_another_split_or_batch_size_is_refused_naming_both():
    """Two ranks trained one batch of 3 each (rows 0-5 of the epoch's order); one process resuming that position would
    have skipped 3 rows and trained rows 3-5 again (before: silently). An epoch's end resumes on any split."""
    data = datasets.Dataset.from_dict({"input_ids": [[i] for i in range(12)]})

    def loader(replicas: int, rank: int = 0, batch_size: int = 3) -> ResumableDataLoader:
        sampler = ResumableSampler(data, num_replicas=replicas, rank=rank, seed=1)
        return ResumableDataLoader(data, batch_size=batch_size, sampler=sampler, collate_fn=lambda rows: rows)

    trained = loader(2)
    next(iter(trained))
    state = trained.state_dict()
    refused = r"by 2 data-parallel rank\(s\) with batch_size=3; this run has 1 with batch_size=3"
    with pytest.raises(ValueError, match=refused):
        loader(1).load_state_dict(state)
    with pytest.raises(ValueError, match=r"this run has 2 with batch_size=2"):
        loader(2, batch_size=2).load_state_dict(state)
    same = loader(2, rank=1)
    same.load_state_dict(state)
    assert [row for batch in same for row in batch] == [row for batch in list(loader(2, rank=1))[1:] for row in batch]
    other = loader(1)
    other.load_state_dict({"epoch": 1, "batches": 0})
    assert len(list(other)) == 4
