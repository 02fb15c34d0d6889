import csv
import importlib.util
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import wandb
import yaml
from wandb.sdk.launch.sweeps.utils import create_sweep_command, create_sweep_command_args

from lit_memtrain.callbacks.memory_bounded_throughput import MemoryBoundedThroughput
from lit_memtrain.callbacks.memory_monitor import MemoryMonitor
from lit_memtrain.cli import MemTrainCLI, main
from lit_memtrain.cli.library_noise import RANK_ZERO_LOGGER
from lit_memtrain.datamodules.sft import SFTDataModule
from lit_memtrain.objectives.causal_lm import CausalLMModule

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("sweep_grid", ROOT / "benchmarks" / "sweep_grid.py")
sweep_grid = sys.modules.setdefault("sweep_grid", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(sweep_grid)  # its OBJECTIVE: what it reads from each run's output
SWEEP = yaml.safe_load((ROOT / "configs" / "sweep.yaml").read_text())
CHECKPOINTING = SWEEP["parameters"]["trainer.callbacks+"]["values"]
# Shrinks the base config's Qwen3-0.6B to a model a test can build; not one of the swept keys.
TINY = ["--model.preset=tiny-qwen3", "--model.config_overrides={vocab_size: 512}", "--model.dtype=float32"]


def agent_command(sampled: dict) -> list[str]:
    """The command line a `wandb agent` runs for one sampled configuration, built with wandb's own formatting."""
    flags = create_sweep_command_args({"args": {key: {"value": value} for key, value in sampled.items()}})["args"]
    macros = {"${env}": ["/usr/bin/env"], "${program}": [SWEEP["program"]], "${args}": flags}
    command = []
    for part in create_sweep_command(SWEEP["command"]):
        command += macros.get(part, [part])
    return command


def test_sweep_definition_runs_lit_memtrain_fit_for_the_objective_the_base_config_logs():
    assert SWEEP["method"] in ("bayes", "random")
    assert SWEEP["metric"] == {"name": "sweep/objective", "goal": "maximize"}
    base = yaml.safe_load((ROOT / "configs" / "sweep_base.yaml").read_text())
    assert base["trainer"]["logger"]["class_path"] == "lightning.pytorch.loggers.WandbLogger"
    assert base["trainer"]["logger"]["init_args"]["project"] == SWEEP["project"]
    assert base["trainer"]["callbacks"][-1]["class_path"].endswith("MemoryBoundedThroughput")
    swept = {
        "model.learning_rate", "data.packing", "model.attn_implementation", "model.loss_chunk_size", "trainer.callbacks+"
    }
    assert set(SWEEP["parameters"]) == swept


@pytest.mark.parametrize(
    ("checkpointing", "packing"),
    list(zip(CHECKPOINTING, [True, False, True, False, True])),
    ids=["off", "full", "selective", "offload", "selective+offload"],
)
def test_an_agent_command_parses_to_the_sampled_values(checkpointing, packing, monkeypatch):
    sampled = {
        "model.learning_rate": 3e-05,
        "data.packing": packing,
        "model.attn_implementation": "sdpa_by_document" if packing else "sdpa",
        "model.loss_chunk_size": 256,
        "trainer.callbacks+": checkpointing,
    }
    command = agent_command(sampled)
    assert command[:5] == ["/usr/bin/env", "lit-memtrain", "fit", "--config", "configs/sweep_base.yaml"]
    assert "--model.learning_rate=3e-05" in command and "--model.loss_chunk_size=256" in command
    assert f"--data.packing={packing}" in command and f"--trainer.callbacks+={checkpointing}" in command

    monkeypatch.chdir(ROOT)  # the agent runs from the repository root
    args = command[3:5] + TINY + command[5:]  # run=False parses without the `fit` subcommand
    cli = MemTrainCLI(CausalLMModule, SFTDataModule, args=args, run=False)
    assert cli.model.hparams.learning_rate == 3e-05
    assert cli.model.hparams.loss_chunk_size == 256
    assert cli.datamodule.packing is packing
    assert cli.model.hparams.attn_implementation == sampled["model.attn_implementation"]
    callbacks = [c for c in cli.trainer.callbacks if type(c).__module__.startswith("lit_memtrain.callbacks")]
    assert [type(c) for c in callbacks[:2]] == [MemoryMonitor, MemoryBoundedThroughput]
    if checkpointing == "[]":
        assert len(callbacks) == 2
    else:
        expected = yaml.safe_load(checkpointing)["init_args"]
        (checkpoint,) = callbacks[2:]
        assert type(checkpoint).__name__ == "GradientCheckpointing"
        assert {"selective": checkpoint.selective, "offload": checkpoint.offload} == expected


def _read_run(run_dir: Path) -> tuple[dict, list[dict], dict]:
    """Config, history rows and summary of an offline run, read from its .wandb log with wandb's own reader."""
    (log,) = run_dir.glob("run-*.wandb")
    result = subprocess.run(
        [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(log)],
        capture_output=True, text=True, timeout=60, check=True,
    )
    config, history, summary = {}, [], {}
    for record in map(json.loads, result.stdout.splitlines()):
        if record["type"] == "config":
            config.update(record["config"]["update"])
        elif record["type"] == "history":
            history.append(record["history"]["item"])
        elif record["type"] == "summary":
            summary.update(record["summary"]["update"])
    return config, history, summary


def test_offline_fit_writes_a_local_run_with_config_metrics_memory_and_positional_loss(tmp_path, monkeypatch):
    lines: list[str] = []  # what rank_zero_info logs, as a user sees it
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger(RANK_ZERO_LOGGER).addHandler(handler)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    command = agent_command({
        "model.learning_rate": 0.0003,
        "data.packing": True,
        "model.attn_implementation": "sdpa_by_document",
        "model.loss_chunk_size": 256,
        "trainer.callbacks+": CHECKPOINTING[1],  # full checkpointing
    })
    try:
        main([
            "fit", "--config", str(ROOT / "configs" / "sweep_base.yaml"), *TINY,
            "--trainer.max_steps=6", "--trainer.accelerator=cpu", "--trainer.precision=32-true",
            "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
            f"--trainer.logger.init_args.save_dir={tmp_path}",
            "--data.max_length=64", "--data.batch_size=8", "--data.val_size=16",
            "--trainer.val_check_interval=6", "--trainer.limit_val_batches=2",
            "--trainer.callbacks.init_args.warmup_steps=2",
            "--trainer.callbacks+=lit_memtrain.callbacks.positional_loss.PositionalLoss",
            "--trainer.callbacks.bucket_width=8",
            *command[5:],
        ])
    finally:
        wandb.finish()
        logging.getLogger(RANK_ZERO_LOGGER).removeHandler(handler)

    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    config, history, summary = _read_run(run_dir)
    assert config["learning_rate"] == 0.0003 and config["loss_chunk_size"] == 256 and config["preset"] == "tiny-qwen3"

    steps = [row for row in history if "train/loss" in row]
    assert [row["trainer/global_step"] for row in steps] == list(range(6))
    assert all(row["memory/rss_gib"] > 0.05 and row["train/tokens_per_sec"] > 0 for row in steps)
    tokens = {row["trainer/global_step"]: row["train/tokens"] for row in steps}
    assert summary["sweep/tokens"] == tokens[5] - tokens[1]  # steps 2..5, after warmup_steps=2
    assert summary["sweep/within_memory_bound"] == 1
    assert summary["sweep/objective"] == summary["sweep/tokens_per_sec"] > 0
    assert summary["sweep/peak_memory_gib"] == pytest.approx(max(row["memory/rss_gib"] for row in steps), rel=0.05)
    assert "val/loss" in summary
    # The same figures in one printed line, which benchmarks/sweep_grid.py reads offline.
    (line,) = [line for line in lines if line.startswith("sweep/objective ")]
    found = sweep_grid.OBJECTIVE.search(line)
    assert found and float(found[1]) == pytest.approx(summary["sweep/objective"], abs=0.05)
    assert float(found[3]) == pytest.approx(summary["sweep/peak_memory_gib"], abs=0.005)
    assert line.endswith("(within max_memory_gib=20)")

    written = sorted(p.name for p in (tmp_path / "positional_loss").iterdir())
    assert written == ["loss_by_position_step6.csv", "loss_by_position_step6.png"]  # none for the sanity check
    table = json.loads((run_dir / "files" / summary["val/loss_by_position.path"]).read_text())
    with (tmp_path / "positional_loss" / "loss_by_position_step6.csv").open() as file:
        rows = list(csv.reader(file))
    assert table["columns"] == rows[0] == ["start", "end", "mean_loss", "tokens"]
    assert table["data"] == [[int(r[0]), int(r[1]), float(r[2]), int(r[3])] for r in rows[1:]]
    assert (run_dir / "files" / summary["val/loss_by_position_plot.path"]).stat().st_size > 0
    assert summary["val/unigram_entropy"] > 0
