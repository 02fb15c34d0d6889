"""Throughput monitoring: tokens and attention pairs counted from host batches, model FLOPs from the config,
a device sync only every log_every_n_steps, no .item() in the training step, MFU only where a peak is known."""

from __future__ import annotations

import csv
import traceback

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import CSVLogger
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM

import lit_memtrain.objectives.throughput as throughput_file
from lit_memtrain.datamodules.collate import PaddedCollator
from lit_memtrain.datamodules.padding_free import PaddingFreeCollator
from lit_memtrain.objectives.causal_lm import CausalLMModule
from lit_memtrain.models.presets import build_config
from lit_memtrain.objectives.throughput import (
    ThroughputMeter,
    attention_pairs,
    count_tokens,
    matmul_parameters,
    training_flops,
)

DOCS = [{"input_ids": ids, "labels": ids} for ids in ([5, 6, 7, 8, 9, 10], [11, 12, 13], [20, 21, 22, 23])]


def test_tokens_and_attention_pairs_of_padded_and_padding_free_batches():
    padded = PaddedCollator(pad_token_id=0, pad_to_multiple_of=8)(DOCS)
    flat = PaddingFreeCollator(pad_token_id=0, pad_to_multiple_of=16)(DOCS)
    assert count_tokens(padded) == count_tokens(flat) == 13
    pairs = 6 * 7 // 2 + 3 * 4 // 2 + 4 * 5 // 2  # causal: each token sees itself and its document's earlier ones
    assert attention_pairs(padded) == pairs
    assert attention_pairs(flat) == pairs + 3 * 4 // 2  # the 3 padding tokens form a segment of their own
    assert attention_pairs({"input_ids": torch.zeros(2, 4, dtype=torch.long)}) == 2 * 10


def test_model_flops_count_every_matrix_but_the_input_embedding_and_a_share_of_the_experts():
    llama = AutoModelForCausalLM.from_config(build_config("tiny-llama"))  # untied head: counted on its own
    matrices = sum(p.numel() for n, p in llama.named_parameters() if p.dim() == 2 and "embed_tokens" not in n)
    assert matmul_parameters(llama) == matrices
    config = llama.config
    width = config.num_attention_heads * (config.hidden_size // config.num_attention_heads)
    assert training_flops(llama, 100, 600) == 6 * matrices * 100 + 12 * config.num_hidden_layers * width * 600
    qwen = AutoModelForCausalLM.from_config(build_config("tiny-qwen3"))  # tied head: the embedding matrix counts once
    embedding = qwen.get_input_embeddings().weight.numel()
    assert matmul_parameters(qwen) == sum(p.numel() for p in qwen.parameters() if p.dim() == 2)
    assert matmul_parameters(qwen) > embedding
    moe = AutoModelForCausalLM.from_config(
        build_config("tiny-qwen3", {"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 1, "moe_intermediate_size": 32})
    )
    experts = sum(p.numel() for n, p in moe.named_parameters() if ".experts." in n)
    dense = sum(p.numel() for n, p in moe.named_parameters() if p.dim() >= 2 and ".experts." not in n)
    assert experts > 0 and matmul_parameters(moe) == dense + experts / 4


def _fit(
    tmp_path, max_steps: int, every: int, accumulate: int = 1, padded: bool = True, **module_kwargs
) -> tuple[CausalLMModule, list[dict[str, str]]]:
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 10:] = 0
    batch = {"input_ids": ids, "labels": ids.masked_fill(mask == 0, -100), "attention_mask": mask}
    if not padded:  # transformers reads a padding mask's values to build its attention mask
        batch = {"input_ids": ids, "labels": ids}
    batches = [batch] * (max_steps * accumulate)
    module = CausalLMModule(preset="tiny-qwen3", **module_kwargs)
    trainer = Trainer(
        accelerator="cpu", max_steps=max_steps, log_every_n_steps=every, accumulate_grad_batches=accumulate,
        logger=CSVLogger(tmp_path, name="", version=""), enable_progress_bar=False, enable_checkpointing=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(module, DataLoader(batches, batch_size=None))
    with (tmp_path / "metrics.csv").open() as file:
        return module, [row for row in csv.DictReader(file)]


def test_the_meter_counts_a_models_parameters_once_and_again_for_another_model(monkeypatch):
    """Counting walks every module and parameter (host time at each window's end); a fit's model keeps its shapes."""
    counted = []
    monkeypatch.setattr(throughput_file, "matmul_parameters", lambda m: counted.append(m) or matmul_parameters(m))
    models = [AutoModelForCausalLM.from_config(build_config("tiny-qwen3", {"num_hidden_layers": n})) for n in (1, 2)]
    batch = {"input_ids": torch.zeros(1, 8, dtype=torch.long)}
    meter, cpu = ThroughputMeter(), torch.device("cpu")
    meter.start(cpu, 0)
    per_token = []
    for step, model in enumerate([models[0]] * 3 + [models[1]] * 2, start=1):
        meter.count(batch, 1, cpu, None)
        metrics = meter.update(step, 1, 0, model, cpu, "32-true")
        per_token.append(metrics["train/device/flops_per_sec"] / metrics["train/device/tokens_per_sec"])
    assert [id(model) for model in counted] == [id(models[0]), id(models[1])]  # once each, not at every window
    for model, flops in zip([models[0]] * 3 + [models[1]] * 2, per_token):
        assert flops == pytest.approx(training_flops(model, 8, 36) / 8, rel=1e-9)


def test_throughput_is_measured_every_log_every_n_steps_with_one_sync_each(tmp_path, monkeypatch):
    syncs = []
    monkeypatch.setattr(throughput_file, "_synchronize", lambda device: syncs.append(device))
    module, rows = _fit(tmp_path, max_steps=5, every=2)
    assert len(syncs) == 1 + 3  # at the start, then after steps 2, 4 and the last (5)
    assert module.train_tokens_seen == 5 * (16 + 10)
    logged = [row for row in rows if row.get("train/tokens_per_sec")]
    assert len(logged) == 2  # Lightning logs every 2 steps: the windows of steps 1-2 and 3-4
    # Every step trains the same batch: 16 + 10 real tokens, 16 * 17 / 2 + 10 * 11 / 2 causal pairs. The window's
    # seconds cancel out of FLOP/s over tokens/s: the model FLOPs of one batch per token, in each window (float32).
    per_token = training_flops(module.model, 26, 16 * 17 // 2 + 10 * 11 // 2) / 26
    for row in logged:
        assert float(row["train/tokens_per_sec"]) == pytest.approx(float(row["train/device/tokens_per_sec"]))
        flops_per_token = float(row["train/device/flops_per_sec"]) / float(row["train/device/tokens_per_sec"])
        assert flops_per_token == pytest.approx(per_token, rel=1e-6)
        assert "train/device/mfu" not in row or row["train/device/mfu"] == ""  # no peak FLOP/s on a CPU


def test_throughput_is_logged_when_measured_and_reported_at_every_step_until_the_next(tmp_path, monkeypatch):
    """Each self.log costs host time every step (Lightning copies the metric's metadata); a value logged once is
    reported by Lightning at every later step of the epoch, so the figures the logger and the bar get are the same."""
    logged, shown = [], []
    log = CausalLMModule.log

    def counted(self, name, value, *args, **kwargs):
        if "per_sec" in name:
            logged.append((self.trainer.global_step, name))
        return log(self, name, value, *args, **kwargs)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        end(self, outputs, batch, batch_idx)
        shown.append(self.trainer.progress_bar_metrics.get("train/tokens_per_sec"))
        latest = self.throughput.metrics.get("train/tokens_per_sec")  # logged as a float32 host tensor
        assert shown[-1] == (None if latest is None else float(torch.tensor(latest, dtype=torch.float32)))

    end = CausalLMModule.on_train_batch_end
    monkeypatch.setattr(CausalLMModule, "log", counted)
    monkeypatch.setattr(CausalLMModule, "on_train_batch_end", on_train_batch_end)
    _, rows = _fit(tmp_path, max_steps=5, every=2)
    names = ["train/tokens_per_sec", "train/device/tokens_per_sec", "train/device/flops_per_sec"]  # no MFU on a CPU
    assert logged == [(step, name) for step in (2, 4, 5) for name in names]  # the windows' ends, the last step
    assert shown[0] is None and None not in shown[1:] and shown[1] == shown[2] != shown[3]  # steps 2-3, then 4
    assert [row["step"] for row in rows if row.get("train/tokens_per_sec")] == ["1", "3"]  # logger: steps 2 and 4


def test_mfu_is_model_flops_per_second_over_the_devices_peak(tmp_path, monkeypatch):
    monkeypatch.setattr(throughput_file, "peak_flops", lambda device, dtype: 1e9)
    _, rows = _fit(tmp_path, max_steps=2, every=1)
    row = [row for row in rows if row.get("train/device/mfu")][-1]
    assert float(row["train/device/mfu"]) == pytest.approx(float(row["train/device/flops_per_sec"]) / 1e9)


class _CountScalarReads(TorchDispatchMode):
    """Records reads of a tensor's value into Python (``.item()``, ``float()``, ``int()``: device syncs on a
    GPU) made by lit_memtrain's own code (the model's own code reads some, for its masks)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            caller = next(f for f in reversed(traceback.extract_stack()[:-1]) if "/torch/" not in f.filename)
            if "lit_memtrain" in caller.filename:
                self.reads.append(f"{caller.filename}:{caller.lineno}")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("accumulate", [1, 2])
def test_the_training_step_reads_no_value_from_the_device(tmp_path, monkeypatch, accumulate):
    counter = _CountScalarReads()
    training_step = CausalLMModule.training_step

    def counted(self, batch, batch_idx):
        self.run_setup_probes(batch)  # the one-off setup probe is not part of the step
        with counter:
            return training_step(self, batch, batch_idx)

    monkeypatch.setattr(CausalLMModule, "training_step", counted)
    # sdpa: the attention's own mask construction (transformers' for sdpa, ours for sdpa_by_document) reads
    # position values once per forward to find packed documents; this test is about the step around it.
    _fit(tmp_path, max_steps=2, every=1, accumulate=accumulate, padded=False, attn_implementation="sdpa")
    assert counter.reads == []


@pytest.mark.parametrize(
    ("device_name", "dtype", "expected"),
    [
        ("NVIDIA H200", torch.bfloat16, 989.0e12),  # Lightning's table knows only "h200 sxm1" (and sparse figures)
        ("NVIDIA H200 NVL", torch.bfloat16, 835.5e12),
        ("NVIDIA H100 80GB HBM3", torch.bfloat16, 989.0e12),
        ("NVIDIA H100 PCIe", torch.float16, 756.0e12),
        ("NVIDIA GH200 480GB", torch.float32, 66.9e12),
        ("NVIDIA A100-SXM4-80GB", torch.bfloat16, 312.0e12),
        ("Tesla T4", torch.float16, 65e12),  # not in our table: Lightning's
        ("Some Future GPU", torch.bfloat16, None),
    ],
)
def test_peak_flops_are_dense_datasheet_figures_by_cuda_device_name(monkeypatch, device_name, dtype, expected):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: device_name)
    assert throughput_file.peak_flops(torch.device("cuda", 0), dtype) == expected


def test_mfu_is_logged_on_an_h200(monkeypatch):
    """What the first GPU run missed ("FLOPs not found for 'NVIDIA H200'"): the meter's measurement has an MFU."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr(throughput_file, "_synchronize", lambda device: None)
    model = AutoModelForCausalLM.from_config(build_config("tiny-qwen3"))
    ids = torch.arange(16).view(1, 16)
    meter = throughput_file.ThroughputMeter()
    meter.start(torch.device("cuda", 0), 0)
    meter.count({"input_ids": ids, "labels": ids}, 1, torch.device("cuda", 0), reduce=None)
    metrics = meter.update(1, 1, 1, model, torch.device("cuda", 0), "bf16-true")
    assert metrics["train/device/mfu"] == pytest.approx(metrics["train/device/flops_per_sec"] / 989.0e12)
