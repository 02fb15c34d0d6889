"""GRPO end to end: ``lit-memtrain fit --config configs/grpo.yaml`` parses with its reward functions and tokenizer
linked, trains through the CLI and exports, and (the ``slow`` test, a minute of CPU) raises the mean reward."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import wandb
from transformers import AutoModelForCausalLM

from lit_memtrain.cli import MemTrainCLI, main, names_model_class
from lit_memtrain.datamodules.embedded import write_embedded_prompts
from lit_memtrain.datamodules.prompts import PromptDataModule
from lit_memtrain.objectives.causal_lm import CausalLMModule
from lit_memtrain.objectives.grpo import GRPOModule

ROOT = Path(__file__).resolve().parents[2]
GRPO_CONFIG = str(ROOT / "configs" / "grpo.yaml")
SMALL = "{hidden_size: 64, intermediate_size: 128, num_hidden_layers: 2, head_dim: 16}"
MEAN_REWARD = re.compile(r"mean reward: first (\d+) batches ([\d.]+) -> last \d+ batches ([\d.]+) over (\d+) batches")


def _fit(tmp_path: Path, *args: str) -> str:
    try:
        main(["fit", "--config", GRPO_CONFIG, "--trainer.enable_progress_bar=false",
              f"--trainer.logger.init_args.save_dir={tmp_path}", f"--model.export_dir={tmp_path / 'export'}", *args])
    finally:
        wandb.finish()  # the config logs to W&B (offline): later fits must not reuse this run
    return str(tmp_path / "export")


def test_the_grpo_config_parses_as_named_classes_with_the_reward_functions():
    assert names_model_class(["fit", "--config", GRPO_CONFIG])
    cli = MemTrainCLI(
        CausalLMModule, PromptDataModule, subclass_mode_model=True, subclass_mode_data=True,
        args=["--config", GRPO_CONFIG, "--model.num_generations=4", "--model.beta=0.04"], run=False,
    )
    assert isinstance(cli.model, GRPOModule) and isinstance(cli.datamodule, PromptDataModule)
    assert cli.model.reward_functions.names == ["exact_answer", "digits_only"]
    assert cli.model.reward_functions.weights.tolist() == [1.0, 0.5]
    assert cli.model.num_generations == 4 and cli.model.hparams.beta == 0.04
    assert cli.model.hparams.tokenizer == cli.datamodule.tokenizer_name == "lit-memtrain/embedded"
    assert cli.model.hparams.policy_loss == "dapo" and not cli.model.automatic_optimization


def test_the_grpo_config_trains_and_exports_through_the_cli(tmp_path, capsys):
    data = write_embedded_prompts(tmp_path / "prompts.jsonl", num_examples=16)
    export = _fit(tmp_path, "--trainer.max_steps=3", f"--model.config_overrides={SMALL}", "--model.num_generations=4",
                  "--model.max_completion_length=4", f"--data.dataset={data}", "--data.batch_size=2")
    out = capsys.readouterr().out
    batches = int(MEAN_REWARD.search(out).group(4))
    assert batches == 3 and "over 3 steps" in out
    assert AutoModelForCausalLM.from_pretrained(export).config.num_hidden_layers == 2
    assert list(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))  # train/reward and the rest went to W&B (offline)


@pytest.mark.slow
def test_the_grpo_config_raises_the_mean_reward(tmp_path, capsys, request):
    if "slow" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("the whole configs/grpo.yaml run takes about a minute of CPU: run it with -m slow")
    _fit(tmp_path)
    window, first, last, batches = MEAN_REWARD.search(capsys.readouterr().out).groups()
    assert int(batches) == 60 and int(window) == 10
    assert float(first) < 0.15 and float(last) > float(first) + 0.25
