import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import wandb
from transformers import AutoModelForCausalLM

from lit_memtrain.cli import MemTrainCLI, main
from lit_memtrain.datamodules.embedded import write_embedded_preferences
from lit_memtrain.datamodules.preference import PreferenceDataModule
from lit_memtrain.datamodules.sft import SFTDataModule
from lit_memtrain.objectives.causal_lm import CausalLMModule
from lit_memtrain.strategies import FSDP2Strategy

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = str(ROOT / "configs" / "quickstart.yaml")
DPO_CONFIG = str(ROOT / "configs" / "dpo.yaml")


def test_twenty_step_fit_through_the_cli(tmp_path, capsys):
    export = tmp_path / "export"
    main([
        "fit",
        "--config", QUICKSTART,
        "--trainer.max_steps=20",
        "--trainer.val_check_interval=20",
        "--trainer.limit_val_batches=2",
        "--trainer.enable_progress_bar=false",
        f"--trainer.logger.init_args.save_dir={tmp_path}",
        "--model.config_overrides={hidden_size: 64, intermediate_size: 128, num_hidden_layers: 2, head_dim: 16}",
        "--model.learning_rate=0.005",
        f"--model.export_dir={export}",
        "--data.batch_size=16",
    ])
    out = capsys.readouterr().out
    first, last = map(float, re.search(r"train loss: first ([\d.]+) -> last ([\d.]+) over 20 steps", out).groups())
    assert last < first - 0.5
    assert AutoModelForCausalLM.from_pretrained(export).config.num_hidden_layers == 2
    wandb.finish()
    assert list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))


def test_quickstart_config_parses_and_links_the_tokenizer():
    cli = MemTrainCLI(CausalLMModule, SFTDataModule, args=["--config", QUICKSTART, "--model.learning_rate=0.01"], run=False)
    assert isinstance(cli.model, CausalLMModule) and isinstance(cli.datamodule, SFTDataModule)
    assert cli.model.hparams.learning_rate == 0.01
    assert cli.model.hparams.tokenizer == cli.datamodule.tokenizer_name == "lit-memtrain/embedded"
    assert cli.datamodule.max_length == 64
    cli.model.configure_model()
    assert cli.model.model.config.vocab_size == 512 > len(cli.datamodule.tokenizer)  # the preset's vocabulary


def test_fit_help_runs_as_a_console_command():
    result = subprocess.run(
        [sys.executable, "-m", "lit_memtrain.cli", "fit", "--help"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    for option in ("--model.loss_type", "--model.attn_implementation", "--data.max_length", "--data.pad_to_multiple_of"):
        assert option in result.stdout


def test_the_cli_sets_expandable_segments_unless_the_user_chose(monkeypatch):
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == os.environ["PYTORCH_ALLOC_CONF"] == "expandable_segments:True"
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "backend:native")
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    assert os.environ["PYTORCH_ALLOC_CONF"] == "backend:native" and "PYTORCH_CUDA_ALLOC_CONF" not in os.environ


def test_lengths_profiles_the_fit_data_and_writes_a_histogram(tmp_path, capsys):
    histogram = tmp_path / "lengths.png"
    main(["lengths", "--config", QUICKSTART, "--candidates=[16, 32, 64]", f"--histogram={histogram}"])
    out = capsys.readouterr().out
    assert re.search(r"\* 32\s+0\.00%\s+0\.00%", out), out
    assert "16      " in out and histogram.stat().st_size > 0


def test_lengths_profiles_a_sample_of_a_stream(tmp_path, capsys):
    histogram = tmp_path / "lengths.png"
    main(["lengths", "--config", QUICKSTART, "--data.streaming=true", "--sample=300", f"--histogram={histogram}"])
    assert re.search(r"^300 examples, ", capsys.readouterr().out, re.MULTILINE)


def test_lengths_profiles_the_sequences_of_preference_pairs_as_training_builds_them(tmp_path, capsys):
    """configs/dpo.yaml: each pair's prompt + chosen and prompt + rejected sequence, prompts cut to
    max_prompt_length as training cuts them, against the sequences the collator puts in a padding-free row."""
    data = write_embedded_preferences(tmp_path / "pairs.jsonl", num_examples=40)
    histogram = tmp_path / "lengths.png"
    main(["lengths", "--config", DPO_CONFIG, f"--data.dataset={data}", "--data.max_prompt_length=12",
          "--candidates=[16, 32]", f"--histogram={histogram}"])  # fmt: skip
    out = capsys.readouterr().out

    trained = PreferenceDataModule(  # no sequence is cut
        dataset=str(data), max_length=4096, max_prompt_length=12, prompt_truncation="keep_end"
    )
    trained.setup("fit")
    row = trained.collator()(list(trained.train_dataset))
    lengths = np.diff(row["cu_seq_lens_q"].numpy())
    assert len(lengths) == 80
    total, over_16 = int(lengths.sum()), int(np.maximum(lengths - 16, 0).sum())
    assert f"80 examples, {total:,} tokens" in out
    assert re.search(rf"^\s+16\s+{100 * over_16 / total:.2f}%", out, re.MULTILINE), out
    prompts = trained.token_counts["train"]  # the pairs' tokens as read, and the prompt tokens cut
    assert prompts.truncated_tokens > 0
    assert f"max_prompt_length=12 as in training: {prompts.truncated_tokens:,} of {prompts.tokens:,} tokens" in out
    assert "padded batches: 32 examples each" in out and "a batch of 16 pairs is 32 sequences" in out
    assert "waste packed" not in out and "configured max_length 64: cuts 0.00% of tokens" in out
    assert histogram.stat().st_size > 0


def test_lengths_refuses_data_it_cannot_profile(capsys):
    with pytest.raises(SystemExit):
        main(["lengths", "--config", DPO_CONFIG, "--data.class_path=lightning.pytorch.demos.boring_classes.BoringDataModule"])
    err = capsys.readouterr().err
    assert "data.class_path is 'lightning.pytorch.demos.boring_classes.BoringDataModule': lit-memtrain lengths profiles" in err


OFFLINE_MODEL = ["--model.model=null", "--model.preset=tiny-qwen3", "--data.tokenizer=lit-memtrain/embedded"]


@pytest.mark.parametrize("name", ["long_context", "lora", "multi_gpu"])
def test_shipped_configs_parse_with_an_offline_model(name):
    config = str(ROOT / "configs" / f"{name}.yaml")
    args = ["--config", config, *OFFLINE_MODEL, "--model.attn_implementation=sdpa", "--trainer.accelerator=cpu"]
    cli = MemTrainCLI(CausalLMModule, SFTDataModule, args=args, run=False)
    names = [type(c).__name__ for c in cli.trainer.callbacks]
    assert "GradientCheckpointing" in names and "MemoryMonitor" in names
    assert cli.datamodule.packing
    cli.model.configure_model()
    if name in ("long_context", "multi_gpu"):
        strategy = cli.trainer.strategy
        assert isinstance(strategy, FSDP2Strategy) and strategy.mp_policy.param_dtype == torch.bfloat16
        assert strategy.cpu_offload == (name == "long_context")
        assert strategy.mesh_shape() == {"data_parallel": cli.trainer.num_devices}
        assert "TiledMLP" in names
    if name == "long_context":
        assert cli.model.model.config.rope_parameters["rope_type"] == "yarn"
    elif name == "lora":
        assert cli.model.lora.r == 16 and cli.model.lora.dropout == 0.05
        assert all(p.requires_grad == ("lora_" in n) for n, p in cli.model.model.named_parameters())
