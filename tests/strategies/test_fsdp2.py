"""FSDP2Strategy on CPU (gloo, 2 processes) against one process on the same rows.

Every distributed case runs in one launch: two processes forked from pytest (as Lightning's ``ddp_fork``
does) train one case after another, each with its own ``Trainer(strategy=FSDP2Strategy(...))``, and
rank 0 writes what it saw (first-step gradients, weights after 3 steps, losses, tokens trained). The
references run here, in one process, with the same model, callbacks and rows: each optimizer step's rows of
both ranks and all micro-batches in one batch. Rank 0's rows keep more trainable targets than rank 1's, so
only a loss divided by the trainable tokens of the whole step and both ranks matches.
"""

from __future__ import annotations

import dataclasses
import os
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
from lightning.pytorch import Callback, LightningDataModule, Trainer
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM

from lit_memtrain.callbacks import ActivationOffloading, GradientCheckpointing, MemoryMonitor, TiledMLP
from lit_memtrain.cli import main
from lit_memtrain.datamodules.collate import PaddedCollator
from lit_memtrain.datamodules.padding_free import PaddingFreeCollator
from lit_memtrain.models.lora import LoraSettings
from lit_memtrain.objectives.causal_lm import CausalLMModule
from lit_memtrain.strategies import FSDP2Strategy
from lit_memtrain.objectives.throughput import count_tokens

WORLD = 2
STEPS = 3
ROWS_PER_MICRO_BATCH = 2
LENGTH = 16
VOCAB = 512
LAUNCH_TIMEOUT_S = 480


class SeededModule(CausalLMModule):
    """Builds its model from seed 0 wherever it is built (rank 0 of a sharded run, or the reference)."""

    def configure_model(self) -> None:
        if self.model is None:
            torch.manual_seed(0)
        super().configure_model()


@dataclasses.dataclass(frozen=True)
class Case:
    module: dict[str, Any]
    strategy: dict[str, Any] = dataclasses.field(default_factory=dict)
    callbacks: Callable[[], list[Callback]] = list
    accumulate: int = 1
    packed: bool = False
    precision: str = "32-true"
    export: bool = False
    prebuilt: bool = False
    validate: bool = False  # also validate at the end (each rank on its own rows)
    bf16: bool = False  # computes in bf16: compared with the fp32 reference to bf16's 3 significant digits


def _module_kwargs(preset: str, **extra: Any) -> dict[str, Any]:
    return {"preset": preset, "learning_rate": 1e-3, "warmup": 0, **extra}


def _offloaded_activations() -> list[Callback]:
    return [ActivationOffloading(offload_cpu_tensors_for_testing=True, use_streams=False, max_fwd_stash_size=1)]


CASES: dict[str, Case] = {
    "plain_loss": Case(_module_kwargs("tiny-llama", loss_type="nll"), validate=True),
    "chunked_loss_tied_head": Case(_module_kwargs("tiny-qwen3", loss_chunk_size=5)),
    "chunked_loss_untied_head": Case(_module_kwargs("tiny-llama", loss_chunk_size=5), export=True, validate=True),
    "cpu_offload": Case(_module_kwargs("tiny-qwen3"), {"cpu_offload": True}),
    "checkpointing_full": Case(_module_kwargs("tiny-qwen3"), callbacks=lambda: [GradientCheckpointing()]),
    "checkpointing_selective_cpu_offload": Case(
        _module_kwargs("tiny-llama"), {"cpu_offload": True}, lambda: [GradientCheckpointing(selective=True)]
    ),
    "checkpointing_offload_tiled_mlp": Case(
        _module_kwargs("tiny-qwen3"), callbacks=lambda: [GradientCheckpointing(offload=True), TiledMLP(num_tiles=2)]
    ),
    "tiled_mlp_cpu_offload": Case(_module_kwargs("tiny-qwen3"), {"cpu_offload": True}, lambda: [TiledMLP(num_tiles=3)]),
    "activation_offloading": Case(_module_kwargs("tiny-llama"), callbacks=_offloaded_activations),
    "all_callbacks_cpu_offload_keep_unsharded": Case(
        _module_kwargs("tiny-qwen3"),
        {"cpu_offload": True, "reshard_after_forward": False},
        lambda: [GradientCheckpointing(), TiledMLP(num_tiles=2), *_offloaded_activations(), MemoryMonitor()],
    ),
    "lora_with_adapted_tied_head": Case(
        _module_kwargs("tiny-qwen3", lora=LoraSettings(r=4, alpha=8, lm_head=True)), export=True
    ),
    "lora_cpu_offload": Case(_module_kwargs("tiny-llama", lora=LoraSettings(r=4, alpha=8)), {"cpu_offload": True}),
    "accumulation_2": Case(_module_kwargs("tiny-qwen3"), accumulate=2, callbacks=lambda: [MemoryMonitor()]),
    "packed_rows_by_document": Case(_module_kwargs("tiny-llama", attn_implementation="sdpa_by_document"), packed=True),
    "model_built_before_fit": Case(_module_kwargs("tiny-llama"), prebuilt=True),
    "bf16_compute_fp32_master_weights": Case(_module_kwargs("tiny-qwen3"), {"mixed_precision": "bf16"}, bf16=True),
    "bf16_mixed_autocast": Case(_module_kwargs("tiny-llama"), precision="bf16-mixed", bf16=True),
}


def _examples(step: int, rank: int, micro_batch: int) -> list[dict[str, list[int]]]:
    """Rows of one micro-batch: rank 0 trains on 13-14 targets per row, rank 1 on 4-5."""
    generator = torch.Generator().manual_seed(1000 * step + 100 * rank + micro_batch)
    rows = []
    for row in range(ROWS_PER_MICRO_BATCH):
        ids = torch.randint(1, VOCAB, (LENGTH,), generator=generator).tolist()
        masked = (2 if rank == 0 else 11) + row
        rows.append({"input_ids": ids, "labels": [-100] * masked + ids[masked:]})
    return rows


def _collate(examples: list[dict[str, list[int]]], packed: bool) -> dict[str, Any]:
    return PaddingFreeCollator(pad_token_id=0)(examples) if packed else PaddedCollator(pad_token_id=0)(examples)


def _validation_batches(ranks: range) -> list[dict[str, Any]]:
    return [_collate([row for rank in ranks for row in _examples(STEPS, rank, 0)], packed=False)]


def _rank_batches(case: Case, rank: int) -> list[dict[str, Any]]:
    return [
        _collate(_examples(step, rank, micro), case.packed) for step in range(STEPS) for micro in range(case.accumulate)
    ]


def _reference_batches(case: Case) -> list[dict[str, Any]]:
    return [
        _collate(
            [row for rank in range(WORLD) for micro in range(case.accumulate) for row in _examples(step, rank, micro)],
            case.packed,
        )
        for step in range(STEPS)
    ]


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().cpu().clone()


class Record(Callback):
    """Keeps the first optimizer step's gradients, the weights at the end, every micro-batch's loss and the tokens
    trained (the last logged ``train/tokens``, every rank's ``train_tokens_seen``, the last tokens/s over all
    ranks and on this device, and the tokens this rank held)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.gradients: dict[str, torch.Tensor] | None = None
        self.losses: list[float] = []
        self.validation_losses: list[float] = []
        self.local_tokens = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.local_tokens += int(count_tokens(batch))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.gradients is None:
            named = pl_module.named_parameters()
            self.gradients = {name: _full(p.grad) for name, p in named if p.grad is not None}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(pl_module.last_train_loss)

    def on_validation_end(self, trainer, pl_module) -> None:
        self.validation_losses.append(float(trainer.callback_metrics["val/loss"]))

    def on_train_end(self, trainer, pl_module) -> None:
        weights = {name: _full(p) for name, p in pl_module.named_parameters()}
        seen = trainer.strategy.all_gather(torch.tensor(pl_module.train_tokens_seen)).reshape(-1).tolist()
        if trainer.is_global_zero:
            record = {"gradients": self.gradients, "weights": weights, "losses": self.losses}
            metrics = trainer.callback_metrics
            tokens = {
                "tokens": seen,
                "logged_tokens": float(metrics["train/tokens"]),
                "tokens_per_sec": tuple(float(metrics[f"train/{n}tokens_per_sec"]) for n in ("", "device/")),
                "local_tokens": self.local_tokens,
            }
            torch.save({**record, **tokens, "validation_losses": self.validation_losses}, self.path)


def _trainer(case: Case, record: Record, root: Path, max_steps: int = STEPS, **options: Any) -> Trainer:
    return Trainer(
        max_steps=max_steps,
        accumulate_grad_batches=case.accumulate,
        precision=case.precision,
        callbacks=[*case.callbacks(), record],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        default_root_dir=root,
        **options,
    )


def _new_module(case: Case, directory: Path, with_export: bool = True) -> SeededModule:
    export_dir = str(directory / "export") if case.export and with_export else None
    return SeededModule(**case.module, export_dir=export_dir)


def _run_distributed_case(name: str, case: Case, rank: int, out: Path) -> None:
    directory = out / name
    directory.mkdir(exist_ok=True)
    module = _new_module(case, directory)
    if case.prebuilt:
        module.configure_model()
    trainer = _trainer(
        case, Record(directory / "sharded.pt"), directory,
        accelerator="cpu", devices=WORLD, strategy=FSDP2Strategy(**case.strategy), use_distributed_sampler=False,
    )
    validation = DataLoader(_validation_batches(range(rank, rank + 1)), batch_size=None) if case.validate else None
    trainer.fit(module, DataLoader(_rank_batches(case, rank), batch_size=None), validation)


def _run_resume_case(rank: int, out: Path) -> None:
    """Two steps, a distributed checkpoint, then the third step in a new Trainer; and three steps in one go."""
    # A constant learning rate: the schedule of a 2-step run would differ from that of a 3-step one.
    case = Case(_module_kwargs("tiny-qwen3", min_lr_ratio=1.0), {"cpu_offload": True})
    directory = out / "resume"
    directory.mkdir(exist_ok=True)
    loader = DataLoader(_rank_batches(case, rank)[:2], batch_size=None)  # one epoch = two steps
    options = {"accelerator": "cpu", "devices": WORLD, "use_distributed_sampler": False}
    straight = _trainer(case, Record(directory / "straight.pt"), directory, strategy=FSDP2Strategy(**case.strategy), **options)
    straight.fit(_new_module(case, directory), loader)
    first = _trainer(
        case, Record(directory / "first.pt"), directory, max_steps=2, strategy=FSDP2Strategy(**case.strategy), **options
    )
    first.fit(_new_module(case, directory), loader)
    first.save_checkpoint(directory / "checkpoint")
    resumed = _trainer(case, Record(directory / "resumed.pt"), directory, strategy=FSDP2Strategy(**case.strategy), **options)
    resumed.fit(_new_module(case, directory), loader, ckpt_path=directory / "checkpoint")


def _worker(rank: int, names: list[str], out: Path, port: int) -> None:
    os.environ.update(
        {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(WORLD), "NODE_RANK": "0"}
    )
    os.environ["LOCAL_RANK"] = str(rank)  # Lightning then treats the processes as launched from outside
    torch.set_num_threads(1)
    for name in names:
        try:
            if name == "resume":
                _run_resume_case(rank, out)
            else:
                _run_distributed_case(name, CASES[name], rank, out)
        except Exception:  # noqa: BLE001 - reported by the test of that case
            (out / f"{name}.rank{rank}.error").write_text(traceback.format_exc())
            raise


@pytest.fixture(scope="module")
def distributed_runs(tmp_path_factory) -> Path:
    """All distributed cases, in one launch of two forked processes."""
    out = tmp_path_factory.mktemp("fsdp2")
    context = mp.start_processes(
        _worker, args=([*CASES, "resume"], out, find_free_network_port()), nprocs=WORLD, join=False, start_method="fork"
    )
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    try:
        while not context.join(timeout=max(1.0, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the two FSDP2 processes did not finish within {LAUNCH_TIMEOUT_S} s")
    except Exception:
        for process in context.processes:
            if process.is_alive():
                process.kill()
        errors = sorted(out.glob("*.error"))
        if not errors:
            raise
    return out


def _distributed_result(out: Path, name: str, file: str) -> dict[str, Any]:
    for error in sorted(out.glob(f"{name}.rank*.error")):
        pytest.fail(f"the distributed run of {name} failed on {error.stem}:\n{error.read_text()}")
    return torch.load(out / name / file, weights_only=True)


def _reference(case: Case, directory: Path) -> dict[str, Any]:
    directory.mkdir(parents=True, exist_ok=True)
    module = _new_module(case, directory, with_export=False)
    # bf16 cases are compared with an fp32 run: the fp32 master weights are what FSDP2 keeps in bf16 compute.
    single = Case(case.module, callbacks=case.callbacks, packed=case.packed)
    trainer = _trainer(single, Record(directory / "reference.pt"), directory, accelerator="cpu", devices=1)
    validation = DataLoader(_validation_batches(range(WORLD)), batch_size=None) if case.validate else None
    trainer.fit(module, DataLoader(_reference_batches(case), batch_size=None), validation)
    return torch.load(directory / "reference.pt", weights_only=True)


def assert_tokens_trained(distributed: dict[str, Any], reference: dict[str, Any], tokens: int, ranks: int) -> None:
    """The tokens trained are what one process counts, each once, on every rank (``train_tokens_seen``) and in
    the logged ``train/tokens``; tokens/s over all ranks is that count, rank 0's own tokens/s only its share."""
    assert distributed["tokens"] == [tokens] * ranks and reference["tokens"] == [tokens]
    assert distributed["logged_tokens"] == reference["logged_tokens"] == tokens
    assert 0 < distributed["local_tokens"] < tokens == reference["local_tokens"]
    for record in (distributed, reference):  # both rates over the same window (logged as float32)
        all_ranks, this_device = record["tokens_per_sec"]
        assert all_ranks / this_device == pytest.approx(tokens / record["local_tokens"], rel=1e-6)


def _assert_close_to_reference(sharded: dict[str, Any], reference: dict[str, Any]) -> None:
    assert all(value.dtype == torch.float32 for value in sharded["weights"].values())
    assert_each_equal_up_to_rounding(sharded["gradients"], reference["gradients"], terms=TINY_MODEL_TERMS)
    for name, expected in reference["weights"].items():
        # AdamW turns float noise in near-zero gradients into whole steps of lr: compare relative to the tensor.
        scale = expected.abs().max().item()
        torch.testing.assert_close(sharded["weights"][name], expected, rtol=1e-3, atol=1e-3 * scale, msg=name)


def _assert_bf16_close_to_fp32_reference(sharded: dict[str, Any], reference: dict[str, Any]) -> None:
    """bf16 compute: the first loss to 1e-2 and each gradient to 3e-2 of its norm; fp32 master weights."""
    assert sharded["gradients"].keys() == reference["gradients"].keys()
    assert all(value.dtype == torch.float32 for value in sharded["weights"].values())
    assert sharded["losses"][0] == pytest.approx(reference["losses"][0], rel=1e-2)
    for name, expected in reference["gradients"].items():
        error = (sharded["gradients"][name] - expected).norm() / expected.norm()
        assert error < 3e-2, f"{name}: relative error {error:.3g}"


@pytest.mark.parametrize("name", list(CASES))
def test_two_sharded_ranks_match_one_process(name, distributed_runs, tmp_path):
    case = CASES[name]
    sharded = _distributed_result(distributed_runs, name, "sharded.pt")
    reference = _reference(case, tmp_path)
    if case.bf16:
        _assert_bf16_close_to_fp32_reference(sharded, reference)
    else:
        _assert_close_to_reference(sharded, reference)
    # Validation (each rank on its own rows, the metric reduced over both) is the token mean of all rows.
    assert len(sharded["validation_losses"]) == int(case.validate)
    assert_tokens_trained(sharded, reference, STEPS * case.accumulate * WORLD * ROWS_PER_MICRO_BATCH * LENGTH, WORLD)
    assert sharded["validation_losses"] == pytest.approx(reference["validation_losses"], rel=1e-5)


@pytest.mark.parametrize("name", [name for name, case in CASES.items() if case.export])
def test_export_of_a_sharded_run_equals_the_export_of_its_gathered_weights(name, distributed_runs, tmp_path):
    """The Hugging Face directory written from the shards (LoRA merged) is what one process writes."""
    sharded = _distributed_result(distributed_runs, name, "sharded.pt")
    module = _new_module(CASES[name], tmp_path, with_export=False)
    module.configure_model()
    module.load_state_dict(sharded["weights"], strict=False)
    expected = AutoModelForCausalLM.from_pretrained(module.export(tmp_path / "single")).state_dict()
    exported = AutoModelForCausalLM.from_pretrained(distributed_runs / name / "export").state_dict()
    assert exported.keys() == expected.keys() and not any("lora" in key for key in exported)
    for key, value in expected.items():
        torch.testing.assert_close(exported[key], value, rtol=0, atol=0, msg=key)


def test_a_resumed_sharded_run_reproduces_the_next_step_exactly(distributed_runs):
    straight = _distributed_result(distributed_runs, "resume", "straight.pt")
    first = _distributed_result(distributed_runs, "resume", "first.pt")
    resumed = _distributed_result(distributed_runs, "resume", "resumed.pt")
    assert first["losses"] == straight["losses"][:2]
    assert resumed["losses"] == straight["losses"][2:]
    for name, expected in straight["weights"].items():
        torch.testing.assert_close(resumed["weights"][name], expected, rtol=0, atol=0, msg=name)
    checkpoint = distributed_runs / "resume" / "checkpoint"
    assert len(list(checkpoint.glob("*.distcp"))) == WORLD  # each rank wrote its own shards
    assert not list(checkpoint.parent.glob(".checkpoint.partial-*"))  # written beside, then renamed into place


def test_the_export_command_reads_a_distributed_checkpoint(distributed_runs, tmp_path):
    first = _distributed_result(distributed_runs, "resume", "first.pt")
    main(["export", "--checkpoint", str(distributed_runs / "resume" / "checkpoint"), "--output", str(tmp_path)])
    exported = AutoModelForCausalLM.from_pretrained(tmp_path).state_dict()
    for name, value in first["weights"].items():
        torch.testing.assert_close(exported[name.removeprefix("model.")], value, rtol=0, atol=0, msg=name)


class RowsOfEachRank(LightningDataModule):
    def __init__(self, case: Case) -> None:
        super().__init__()
        self.case = case

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_rank_batches(self.case, self.trainer.global_rank), batch_size=None)


def test_a_forked_fit_returns_the_trained_weights_to_the_calling_process(tmp_path):
    """Trainer(strategy=FSDP2Strategy(start_method="fork")): the notebook path, through Lightning's launcher."""
    case = CASES["chunked_loss_tied_head"]
    module = _new_module(case, tmp_path)
    module.configure_model()
    trainer = _trainer(
        case, Record(tmp_path / "forked.pt"), tmp_path,
        accelerator="cpu", devices=WORLD, strategy=FSDP2Strategy(start_method="fork"), use_distributed_sampler=False,
    )
    trainer.fit(module, datamodule=RowsOfEachRank(case))
    weights = {name: p.detach() for name, p in module.named_parameters()}
    assert not any(isinstance(value, DTensor) for value in weights.values())
    _assert_close_to_reference(
        {"weights": weights, "gradients": {}}, {**_reference(case, tmp_path / "reference"), "gradients": {}}
    )
