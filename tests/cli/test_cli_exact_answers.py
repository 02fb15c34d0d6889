"""Exact-answer accuracy through the command line: the ExactAnswerAccuracy callback in ``lit-memtrain fit`` (scored
before the first step and after the last, logged at each step and printed), and ``lit-memtrain evaluate``."""

import csv
import re
from pathlib import Path

from lit_memtrain.cli import main

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = str(ROOT / "configs" / "quickstart.yaml")
SMALL = "--model.config_overrides={hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, head_dim: 8}"


def test_fit_scores_exact_answers_before_and_after_training(tmp_path, monkeypatch, info_lines):
    monkeypatch.chdir(tmp_path)
    main([
        "fit", "--config", QUICKSTART, SMALL, "--trainer.max_steps=2", "--trainer.limit_val_batches=0",
        "--trainer.enable_progress_bar=false", "--data.batch_size=4",
        "--trainer.logger=lightning.pytorch.loggers.CSVLogger", f"--trainer.logger.save_dir={tmp_path}",
        "--trainer.callbacks+=lit_memtrain.callbacks.ExactAnswerAccuracy", "--trainer.callbacks.num_prompts=6",
        "--trainer.callbacks.max_new_tokens=3",
    ])  # fmt: skip
    text = "\n".join(info_lines)
    assert re.search(r"exact-answer accuracy before training \(step 0\): \d/6 \(\d+\.\d%\)", text)
    assert re.search(r"exact-answer accuracy after training \(step 2\): \d/6", text)
    assert re.search(
        r"on 6 prompts of lit-memtrain/addition-heldout: \d/6 \(.*\) before training -> \d/6 .* after 2", text
    )
    (metrics,) = tmp_path.glob("lightning_logs/version_*/metrics.csv")
    logged = [row for row in csv.DictReader(metrics.open()) if row.get("val/exact_answer_accuracy")]
    assert [row["step"] for row in logged] == ["0", "2"]


def test_evaluate_scores_a_gguf_model_on_held_out_prompts(tiny_gguf, capsys):
    main(["evaluate", "--model", str(tiny_gguf), "--num_prompts=5", "--max_new_tokens=2"])
    out = capsys.readouterr().out
    assert re.search(rf"exact-answer accuracy of {tiny_gguf} on 5 prompts of lit-memtrain/addition-heldout: \d/5", out)
