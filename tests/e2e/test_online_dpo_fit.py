"""Online DPO end to end: ``lit-memtrain fit --config configs/online_dpo.yaml`` trains through the CLI with its reward
functions and tokenizer linked and exports, and (the ``slow`` test, 80 s of CPU) raises the chosen completions'
score."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import wandb
from transformers import AutoModelForCausalLM

from lit_memtrain.cli import main
from lit_memtrain.datamodules.embedded import write_embedded_prompts

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs" / "online_dpo.yaml")
SMALL = "{hidden_size: 64, intermediate_size: 128, num_hidden_layers: 2, head_dim: 16}"
CHOSEN = re.compile(r"mean score of the chosen completions: first (\d+) batches (-?[\d.]+) -> last \d+ batches "
                    r"(-?[\d.]+) over (\d+) batches")


def _fit(tmp_path: Path, *args: str) -> str:
    try:
        main(["fit", "--config", CONFIG, "--trainer.enable_progress_bar=false",
              f"--trainer.logger.init_args.save_dir={tmp_path}", f"--model.export_dir={tmp_path / 'export'}", *args])
    finally:
        wandb.finish()  # the config logs to W&B (offline): later fits must not reuse this run
    return str(tmp_path / "export")


def test_the_online_dpo_config_trains_and_exports_through_the_cli(tmp_path, capsys):
    data = write_embedded_prompts(tmp_path / "prompts.jsonl", num_examples=16)
    export = _fit(tmp_path, "--trainer.max_steps=3", f"--model.config_overrides={SMALL}", "--model.max_new_tokens=4",
                  f"--data.dataset={data}", "--data.batch_size=2")
    out = capsys.readouterr().out
    assert int(CHOSEN.search(out).group(4)) == 3 and "over 3 steps" in out
    assert AutoModelForCausalLM.from_pretrained(export).config.num_hidden_layers == 2


@pytest.mark.slow
def test_the_online_dpo_config_raises_the_chosen_score(tmp_path, capsys, request):
    if "slow" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("the whole configs/online_dpo.yaml run takes about 80 s of CPU: run it with -m slow")
    _fit(tmp_path)
    window, first, last, batches = CHOSEN.search(capsys.readouterr().out).groups()
    assert int(batches) == 150 and int(window) == 10
    assert float(last) > float(first) + 0.5
