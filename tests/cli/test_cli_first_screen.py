"""What a new user sees first: plain help listing only what runs, no warnings about the libraries, a progress bar in
optimizer steps, and one line from each technique callback saying what it changed (on a user's own module too)."""

import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import lightning.pytorch as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset
from transformers import AutoModelForCausalLM

from lit_memtrain.callbacks import ActivationOffloading, ChunkedRMSNorm, GradientCheckpointing, TiledMLP
from lit_memtrain.cli import main
from lit_memtrain.models.presets import build_config
from lit_memtrain.techniques.rms_norm import DEFAULT_CHUNK_ELEMENTS

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = str(ROOT / "configs" / "quickstart.yaml")
SMALL = "--model.config_overrides={hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, head_dim: 8}"


def test_help_is_plain_text_lists_only_fit_and_validate_and_warns_about_nothing(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["lit-memtrain", "fit", "--help"])  # as the console command has it
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(SystemExit) as exit_info:
            main(["fit", "--help"])
        assert exit_info.value.code == 0
        fit_help = capsys.readouterr().out
        with pytest.raises(SystemExit):
            main(["--help"])
    assert not [str(w.message) for w in caught if "LightningCLI's args parameter" in str(w.message)]
    assert "as a datetime.timedelta" in fit_help and "--model.preset PRESET" in fit_help
    assert not re.findall(r":(?:class|func|meth|mod|ref):`|``", fit_help)
    usage = capsys.readouterr().out
    assert "usage: lit-memtrain [-c CONFIG] {fit,validate} ..." in usage
    assert "test" not in usage.split("Available subcommands:")[1] and "predict" not in usage


def test_lengths_triggers_no_jsonargparse_deprecation(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("JSONARGPARSE_DEPRECATION_WARNINGS", "all")  # each use warns, not only a process's first
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        main(["lengths", "--config", QUICKSTART, f"--histogram={tmp_path / 'lengths.png'}"])
    assert [str(w.message) for w in caught if w.category.__name__ == "JsonargparseDeprecationWarning"] == []
    assert "histogram:" in capsys.readouterr().out


def test_a_quickstart_fit_prints_what_a_user_needs(tmp_path):
    """The console command in a fresh process, as a user runs it: stderr without the libraries' noise, the bar in
    optimizer steps, and the lines the module prints when training ends (which Lightning's tqdm bar lost)."""
    command = [
        sys.executable, "-m", "lit_memtrain.cli", "fit", "--config", QUICKSTART, "--trainer.max_steps=3",
        "--trainer.val_check_interval=3", "--trainer.limit_val_batches=1", "--data.batch_size=8", SMALL,
        "--model.export_dir=null",
        "--trainer.callbacks+=lit_memtrain.callbacks.TiledMLP",
        "--trainer.callbacks+=lit_memtrain.callbacks.ChunkedRMSNorm",
    ]  # fmt: skip
    result = subprocess.run(
        command, cwd=tmp_path, capture_output=True, text=True, timeout=300, env={**os.environ, "WANDB_MODE": "offline"}
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stderr.splitlines()
    noise = ("Traceback", "LightningCLI's args", "TPU available", "Tip:", "Seed set", "LeafSpec", "anonymous")
    assert [line for line in lines if any(word in line for word in (*noise, "git root"))] == []
    for expected in (
        "GradientCheckpointing: 2 decoder layers checkpointed (full)",
        "TiledMLP: the MLPs of 2 decoder layers tiled along the sequence (tiles of about max(hidden size, 1024) "
        "tokens)",
        "`Trainer.fit` stopped: `max_steps=3` reached.",
    ):
        assert expected in lines, result.stderr
    norms = r"ChunkedRMSNorm: \d+ norms \(Qwen3RMSNorm\) replaced by fp32 chunks of [\d,]+ elements"
    assert any(re.fullmatch(norms, line) for line in lines), result.stderr
    assert any(line.startswith("GPU available: ") for line in lines)
    out = result.stdout
    assert re.search(r"Epoch 0: 100%\|[^|]*\| 3/3 \[[^\]]*step/s", out), out
    assert "/-" not in out and re.search(r"^train loss: first [\d.]+ -> last [\d.]+ over 3 steps", out, re.MULTILINE)


class MyModule(L.LightningModule):
    """A user's own module holding a Hugging Face causal LM."""

    def __init__(self) -> None:
        super().__init__()
        config = build_config("tiny-qwen3", {"hidden_size": 32, "intermediate_size": 64, "head_dim": 8})
        self.lm = AutoModelForCausalLM.from_config(config)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.lm(input_ids=batch[0], labels=batch[0], use_cache=False).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_each_technique_callback_says_what_it_changed_on_a_users_own_module(info_lines):
    callbacks = [
        GradientCheckpointing(selective=True),
        TiledMLP(num_tiles=2),
        ChunkedRMSNorm(),
        ActivationOffloading(offload_cpu_tensors_for_testing=True),
    ]
    trainer = L.Trainer(
        max_steps=1, accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, callbacks=callbacks,
    )  # fmt: skip
    module = MyModule()
    norms = sum(type(m).__name__ == "Qwen3RMSNorm" for m in module.modules())
    trainer.fit(module, DataLoader(TensorDataset(torch.randint(0, 384, (2, 16))), batch_size=2))
    assert [line for line in info_lines if line.startswith(tuple(type(c).__name__ for c in callbacks))] == [
        "GradientCheckpointing: 2 decoder layers checkpointed (selective)",
        "TiledMLP: the MLPs of 2 decoder layers tiled along the sequence (2 tiles per call)",
        f"ChunkedRMSNorm: {norms} norms (Qwen3RMSNorm) replaced by fp32 chunks of {DEFAULT_CHUNK_ELEMENTS:,} elements",
        "ActivationOffloading: tensors of 1,024 bytes or more saved inside 2 decoder layers copied to host memory "
        "(the 5 most recent also kept on the device)",
    ]


def test_plan_leaves_out_the_lines_the_callbacks_log_in_each_simulation(preloaded_python):
    result = preloaded_python.run("-m", "lit_memtrain.cli", "plan", "--config", QUICKSTART, "--gpu-memory=80")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "FITS" in result.stdout and "GradientCheckpointing" not in result.stderr
