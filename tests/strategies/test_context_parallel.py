"""ContextParallelStrategy on CPU (gloo, one group of 2 ranks) against one process on the whole rows.

Every case runs in one launch: two processes forked from pytest train one case after another, each with its
own ``Trainer(strategy=ContextParallelStrategy(2, ...))`` on the same rows (the group shares them), and rank 0
writes what it saw. The references run here, in one process, with the same module, callbacks and rows. Each
case trains two optimizer steps: the first step's gradients, the weights after both, every micro-batch's
logged loss, and the tokens trained (the logged ``train/tokens``, every rank's ``train_tokens_seen`` and the
end-of-fit summary line) must be one process's.

Tolerances: the module computes in fp32 (the chunked loss's logits are fp32 whatever the weights' dtype), so
the first step's gradients are equal up to fp32 rounding (tests/equivalence.py); weights after two AdamW steps
to 1e-3 of each tensor's scale (AdamW turns float noise in near-zero gradients into whole steps of lr), as the
FSDP2 tests do, and the losses (the second step's follow an AdamW step) to 1e-4. Float64 equality of the
attention itself is tested in tests/parallel/context_parallel.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import io
import json
import logging
import os
import re
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from equivalence import TINY_MODEL_TERMS, assert_each_equal_up_to_rounding
from lightning.fabric.plugins.environments.lightning import find_free_network_port
from lightning.pytorch import Callback, Trainer
from test_fsdp2 import Record, SeededModule, _assert_bf16_close_to_fp32_reference, assert_tokens_trained
from torch.utils.data import DataLoader

from lit_memtrain.callbacks import (
    ActivationOffloading,
    ChunkedRMSNorm,
    GradientCheckpointing,
    PositionalLoss,
    TiledMLP,
)
from lit_memtrain.datamodules.padding_free import PaddingFreeCollator
from lit_memtrain.models.lora import LoraSettings
from lit_memtrain.strategies import ContextParallelStrategy

WORLD = 2
STEPS = 2
VOCAB = 512
LAUNCH_TIMEOUT_S = 300
YARN = {"rope_type": "yarn", "rope_theta": 1_000_000.0, "factor": 4.0, "original_max_position_embeddings": 16}


@dataclasses.dataclass(frozen=True)
class Case:
    documents: tuple[int, ...]  # lengths of the documents of each row (one length: a single-document row)
    strategy: dict[str, Any] = dataclasses.field(default_factory=dict)
    module: dict[str, Any] = dataclasses.field(default_factory=dict)
    callbacks: Callable[[], list[Callback]] = list
    accumulate: int = 1
    padding: int = 0  # tokens the strategy must add to each row
    validate: bool = False
    bf16: bool = False
    precision: str = "32-true"
    data_parallel: int = 1  # > 1: that many groups of 2 ranks, rows handed out by Lightning's sampler


def _offloaded_activations() -> list[Callback]:
    return [ActivationOffloading(offload_cpu_tensors_for_testing=True, use_streams=False, max_fwd_stash_size=1)]


KV1 = {"config_overrides": {"num_key_value_heads": 1}}
# head_dim > 256: transformers' SDPA stops using grouped heads there and repeats keys by the model's ratio (2),
# not by the one each rank holds after the exchange (1 replicated key/value head for 1 query head).
KV1_HEAD_DIM_320 = {"config_overrides": {"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 320}}
CASES: dict[str, Case] = {
    "ulysses_single_document": Case((32,), module={"loss_chunk_size": 5}, validate=True),
    "ulysses_single_document_padded_sdpa": Case((31,), {"inner": "sdpa"}, padding=1),
    "ulysses_sdpa_kv1_head_dim_320": Case((16,), {"inner": "sdpa"}, KV1_HEAD_DIM_320),
    "ulysses_packed_padded_kv2": Case((11, 7, 13), padding=1, validate=True),
    "ulysses_packed_kv1_plain_loss": Case((11, 7, 14), module={"loss_type": "nll", **KV1}),
    "ring_single_document_padded": Case((30,), {"method": "ring"}, padding=2),
    "ring_packed_padded_kv1_positional_loss": Case(
        (9, 14, 6), {"method": "ring"}, KV1, lambda: [PositionalLoss(bucket_width=4)], padding=3, validate=True
    ),
    "ulysses_checkpointing_tiled_mlp_chunked_norm_cpu_offload_yarn_accumulation": Case(
        (10, 12, 9),
        {"cpu_offload": True},
        {"model_init_kwargs": {"rope_parameters": YARN}, "config_overrides": {"max_position_embeddings": 64}},
        lambda: [GradientCheckpointing(selective=True, offload=True), TiledMLP(num_tiles=2), ChunkedRMSNorm(64)],
        accumulate=2,
        padding=1,
    ),
    "ring_lora_activation_offloading_checkpointing": Case(
        (13, 15),
        {"method": "ring"},
        {"lora": LoraSettings(r=4, alpha=8, lm_head=True)},
        lambda: [GradientCheckpointing(), *_offloaded_activations()],
    ),
    "ulysses_bf16_compute": Case((12, 20), {"mixed_precision": "bf16"}, bf16=True),
    "ring_bf16_mixed_autocast": Case((12, 20), {"method": "ring"}, bf16=True, precision="bf16-mixed"),
    "ulysses_bf16_mixed_autocast": Case((12, 20), bf16=True, precision="bf16-mixed"),
}
# On two GPUs (nccl): torch's ring kernels (flash / efficient SDPA in bf16), and Ulysses, against one GPU in fp32.
GPU_CASES: dict[str, Case] = {
    "gpu_torch_ring_bf16": Case((256,), {"method": "ring", "ring_backend": "torch", "mixed_precision": "bf16"}, bf16=True),
    "gpu_ulysses_packed_bf16": Case((100, 60, 96), {"mixed_precision": "bf16"}, bf16=True),
}
# Four ranks, two groups of two: the sampler splits rows over the groups only, FSDP2 shards and reduces over all
# four, and the step's loss is the mean over both groups' rows (their rows train on different numbers of targets).
FOUR_RANK_CASES: dict[str, Case] = {
    "dp2_ulysses_packed": Case((11, 7, 13), data_parallel=2),
    "dp2_ring_packed_cpu_offload": Case((9, 12, 6), {"method": "ring", "cpu_offload": True}, data_parallel=2),
}
ALL_CASES = {**CASES, **GPU_CASES, **FOUR_RANK_CASES}


def _documents(case: Case, seed: int, prompt_share: float = 1 / 3) -> list[dict[str, torch.Tensor]]:
    """The documents of one row, each with a prompt (that share of its tokens) that is not trained on."""
    generator = torch.Generator().manual_seed(seed)
    examples = []
    for length in case.documents:
        ids = torch.randint(1, VOCAB, (length,), generator=generator)
        prompt = int(length * prompt_share)
        examples.append({"input_ids": ids, "labels": torch.cat([torch.full((prompt,), -100), ids[prompt:]])})
    return examples


def _collate(examples: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
    if len(examples) == 1:
        return {"input_ids": examples[0]["input_ids"][None], "labels": examples[0]["labels"][None]}
    return PaddingFreeCollator()(examples)


def _rows(case: Case, step: int, micro_batch: int) -> dict[str, Any]:
    return _collate(_documents(case, 100 * step + micro_batch))


def _dataset_rows(case: Case) -> list[list[dict[str, torch.Tensor]]]:
    """The rows a data-parallel case's sampler hands out: odd rows train on a third of the targets of even ones."""
    return [_documents(case, 1000 + row, 1 / 3 if row % 2 else 2 / 3) for row in range(case.data_parallel * STEPS)]


def _batches(case: Case) -> list[dict[str, Any]]:
    return [_rows(case, step, micro) for step in range(STEPS) for micro in range(case.accumulate)]


def _module(case: Case) -> SeededModule:
    return SeededModule(preset="tiny-qwen3", learning_rate=1e-3, warmup=0, **case.module)


class RecordPositionalLoss(Record):
    """Also keeps PositionalLoss's table."""

    def on_train_end(self, trainer, pl_module) -> None:
        super().on_train_end(trainer, pl_module)
        if trainer.is_global_zero:
            tables = sorted(Path(trainer.default_root_dir, "positional_loss").glob("*.csv"))
            by_position = list(csv.reader(tables[-1].open()))[1:] if tables else []
            record = torch.load(self.path, weights_only=True)
            torch.save({**record, "loss_by_position": by_position}, self.path)


class SamplerIndices(Callback):
    """Writes the dataset indices this rank's sampler hands out (``indices.rank<N>.json``)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def on_train_start(self, trainer, pl_module) -> None:
        indices = list(iter(trainer.train_dataloader.sampler))
        (self.directory / f"indices.rank{trainer.global_rank}.json").write_text(json.dumps(indices))


def _fit(
    case: Case, path: Path, accelerator: str, train: DataLoader, *extra: Callback, max_steps: int = STEPS,
    ckpt_path: Path | None = None, **options: Any,
) -> Trainer:  # fmt: skip
    trainer = Trainer(
        max_steps=max_steps,
        accumulate_grad_batches=case.accumulate,
        precision=case.precision,
        callbacks=[*case.callbacks(), *extra, RecordPositionalLoss(path)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        default_root_dir=path.parent,
        accelerator=accelerator,
        **options,
    )
    validation = DataLoader([_rows(case, STEPS, 0)], batch_size=None) if case.validate else None
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):  # the module's end-of-fit summary, printed by rank 0
        trainer.fit(_module(case), train, validation, ckpt_path=ckpt_path)
    if trainer.is_global_zero:
        summary = re.search(r"train loss: first .* tokens", printed.getvalue())
        record = torch.load(path, weights_only=True)
        torch.save({**record, "summary": summary.group(0) if summary else printed.getvalue()}, path)
    return trainer


# A constant learning rate: the schedule of a 1-step run would differ from that of a 2-step one.
RESUME = Case((11, 7, 13), {"cpu_offload": True}, {"min_lr_ratio": 1.0})


def _run_resume(out: Path, accelerator: str, world: int) -> None:
    """Two steps in one go; and one step, a distributed checkpoint, then the second step in a new Trainer."""
    directory = out / "resume"
    directory.mkdir(exist_ok=True)
    loader = DataLoader(_batches(RESUME)[:1], batch_size=None)  # one epoch = one step: resumed at an epoch's start

    def fit(file: str, **options: Any) -> Trainer:
        strategy = ContextParallelStrategy(WORLD, **RESUME.strategy)
        return _fit(RESUME, directory / file, accelerator, loader, devices=world, strategy=strategy,
                    use_distributed_sampler=False, **options)  # fmt: skip

    fit("straight.pt")
    fit("first.pt", max_steps=1).save_checkpoint(directory / "checkpoint")
    fit("resumed.pt", ckpt_path=directory / "checkpoint")


class _Messages(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _worker(rank: int, names: list[str], out: Path, port: int, accelerator: str, world: int) -> None:
    os.environ.update(
        {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world), "NODE_RANK": "0"}
    )
    os.environ["LOCAL_RANK"] = str(rank)  # Lightning then treats the processes as launched from outside
    torch.set_num_threads(1)
    messages = _Messages()
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addHandler(messages)
    for name in names:
        messages.messages.clear()
        try:
            if name == "resume":
                _run_resume(out, accelerator, world)
                continue
            case = ALL_CASES[name]
            (out / name).mkdir(exist_ok=True)
            strategy = ContextParallelStrategy(context_parallel_size=WORLD, **case.strategy)
            path = out / name / "context_parallel.pt"
            if case.data_parallel == 1:  # every rank of the group the same rows, as the sampler would give them
                loader = DataLoader(_batches(case), batch_size=None)
                _fit(case, path, accelerator, loader, devices=world, strategy=strategy, use_distributed_sampler=False)
            else:
                loader = DataLoader(_dataset_rows(case), batch_size=1, collate_fn=lambda rows: _collate(rows[0]))
                _fit(case, path, accelerator, loader, SamplerIndices(out / name), devices=world, strategy=strategy)
            padding_lines = [message for message in messages.messages if "padded with" in message]
            (out / name / f"padding.rank{rank}.txt").write_text("\n".join(padding_lines))
        except Exception:  # noqa: BLE001 - reported by the test of that case
            (out / f"{name}.rank{rank}.error").write_text(traceback.format_exc())
            raise


def _launch(names: list[str], out: Path, accelerator: str, start_method: str, world: int = WORLD) -> Path:
    """Every case of ``names``, in one launch of ``world`` processes."""
    context = mp.start_processes(
        _worker, args=(names, out, find_free_network_port(), accelerator, world), nprocs=world, join=False,
        start_method=start_method,
    )
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    try:
        while not context.join(timeout=max(1.0, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the {world} context-parallel processes did not finish within {LAUNCH_TIMEOUT_S} s")
    except Exception:
        for process in context.processes:
            if process.is_alive():
                process.kill()
        if not sorted(out.glob("*.error")):
            raise
    return out


@pytest.fixture(scope="module")
def distributed_runs(tmp_path_factory) -> Path:
    return _launch([*CASES, "resume"], tmp_path_factory.mktemp("context-parallel-strategy"), "cpu", "fork")


@pytest.fixture(scope="module")
def four_rank_runs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("context-parallel-strategy-dp2")
    return _launch(list(FOUR_RANK_CASES), out, "cpu", "fork", world=2 * WORLD)


@pytest.fixture(scope="module")
def gpu_runs(tmp_path_factory) -> Path:
    if torch.cuda.device_count() < WORLD:
        pytest.skip(f"needs {WORLD} CUDA devices for a context-parallel group across GPUs, found {torch.cuda.device_count()}")
    # Spawned: other GPU tests of the same pytest process may have initialised CUDA, which forked ranks cannot use.
    return _launch(list(GPU_CASES), tmp_path_factory.mktemp("context-parallel-strategy-gpu"), "gpu", "spawn")


def _result(out: Path, name: str, file: str = "context_parallel.pt") -> dict[str, Any]:
    for error in sorted(out.glob(f"{name}.rank*.error")):
        pytest.fail(f"the context-parallel run of {name} failed on {error.stem}:\n{error.read_text()}")
    return torch.load(out / name / file, weights_only=True)


@pytest.mark.parametrize("name", list(CASES))
def test_a_context_parallel_group_trains_as_one_process_on_the_whole_rows(name, distributed_runs, tmp_path):
    _assert_trains_as_one_process(CASES[name], _result(distributed_runs, name), tmp_path, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_on_two_gpus_a_group_trains_as_one_gpu_within_bf16_tolerance(name, gpu_runs, tmp_path):
    _assert_trains_as_one_process(GPU_CASES[name], _result(gpu_runs, name), tmp_path, "gpu")


@pytest.mark.parametrize("name", list(FOUR_RANK_CASES))
def test_two_groups_of_two_train_as_one_process_on_both_groups_rows(name, four_rank_runs, tmp_path):
    case = FOUR_RANK_CASES[name]
    split = _result(four_rank_runs, name)
    indices = [json.loads((four_rank_runs / name / f"indices.rank{rank}.json").read_text()) for rank in range(4)]
    assert indices[0] == indices[1] and indices[2] == indices[3]  # a group loads the same rows
    assert sorted(indices[0] + indices[2]) == list(range(2 * STEPS))  # the groups split the rows between them
    rows = _dataset_rows(case)
    steps = [_collate(rows[indices[0][step]] + rows[indices[2][step]]) for step in range(STEPS)]
    _assert_trains_as_one_process(case, split, tmp_path, "cpu", DataLoader(steps, batch_size=None))


def _assert_trains_as_one_process(
    case: Case, split: dict[str, Any], tmp_path: Path, accelerator: str, train: DataLoader | None = None
) -> None:
    # bf16 compute is compared with an fp32 run: the fp32 master weights are what FSDP2 keeps in bf16 compute.
    train = train or DataLoader(_batches(case), batch_size=None)
    single = dataclasses.replace(case, strategy={}, precision="32-true")
    _fit(single, tmp_path / "reference.pt", accelerator, train, devices=1)
    reference = torch.load(tmp_path / "reference.pt", weights_only=True)
    # The tokens trained, each once (padding added by the strategy is not a token): what one process counts.
    tokens = sum(case.documents) * STEPS * case.accumulate * case.data_parallel
    assert_tokens_trained(split, reference, tokens, WORLD * case.data_parallel)
    assert split["summary"].endswith(f"over {STEPS} steps, {tokens} tokens"), split["summary"]
    assert reference["summary"].endswith(f"over {STEPS} steps, {tokens} tokens"), reference["summary"]
    if case.bf16:
        _assert_bf16_close_to_fp32_reference(split, reference)
        return
    if case.data_parallel == 1:  # the logged loss is the mean of the group's rows (rank 0's group)
        assert split["losses"] == pytest.approx(reference["losses"], rel=1e-4)
    assert split["validation_losses"] == pytest.approx(reference["validation_losses"], rel=1e-4)
    assert len(split["validation_losses"]) == int(case.validate)
    assert_each_equal_up_to_rounding(split["gradients"], reference["gradients"], terms=TINY_MODEL_TERMS)
    for key, expected in reference["weights"].items():
        scale = expected.abs().max().item()
        torch.testing.assert_close(split["weights"][key], expected, rtol=1e-3, atol=1e-3 * scale, msg=key)
    # PositionalLoss: the same buckets, token counts and mean losses (each token once, at its global position)
    split_table, reference_table = split["loss_by_position"], reference["loss_by_position"]
    assert len(split_table) == len(reference_table) > 0 or not any(isinstance(c, PositionalLoss) for c in case.callbacks())
    for got, expected in zip(split_table, reference_table, strict=True):
        assert (got[0], got[1], got[3]) == (expected[0], expected[1], expected[3])
        assert float(got[2]) == pytest.approx(float(expected[2]), rel=1e-4)


def test_a_resumed_context_parallel_run_reproduces_the_second_step_exactly(distributed_runs):
    straight = _result(distributed_runs, "resume", "straight.pt")
    first = _result(distributed_runs, "resume", "first.pt")
    resumed = _result(distributed_runs, "resume", "resumed.pt")
    assert first["losses"] == straight["losses"][:1] and resumed["losses"] == straight["losses"][1:]
    # The token counter is checkpointed summed over the ranks: the resumed run ends where the straight one does.
    tokens = sum(RESUME.documents) * 2
    assert first["tokens"] == [tokens // 2] * WORLD and first["logged_tokens"] == tokens // 2
    assert resumed["tokens"] == straight["tokens"] == [tokens] * WORLD
    assert resumed["logged_tokens"] == straight["logged_tokens"] == tokens
    assert resumed["summary"].endswith(f"over 2 steps, {tokens} tokens"), resumed["summary"]
    for key, expected in straight["weights"].items():
        torch.testing.assert_close(resumed["weights"][key], expected, rtol=0, atol=0, msg=key)
    assert len(list((distributed_runs / "resume" / "checkpoint").glob("*.distcp"))) == WORLD


@pytest.mark.parametrize("name", list(CASES))
def test_the_padding_added_is_logged_once_in_tokens(name, distributed_runs):
    _result(distributed_runs, name)
    case = CASES[name]
    lines = (distributed_runs / name / "padding.rank0.txt").read_text().splitlines()
    if not case.padding:
        assert lines == []
        return
    length = sum(case.documents)
    assert len(lines) == 1, lines  # every row of the run is padded, once logged
    assert f"rows of {length} tokens padded with {case.padding} tokens to {length + case.padding}" in lines[0]
    assert (distributed_runs / name / "padding.rank1.txt").read_text() == ""  # rank 0 only
