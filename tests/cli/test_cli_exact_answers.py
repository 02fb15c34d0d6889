"""Exact-answer accuracy through the command line: the ExactAnswerAccuracy callback in ``lit-memtrain fit`` (scored
before the first step and after the last, logged at each step and printed), and ``lit-memtrain evaluate``."""

import csv
import json
import re
from pathlib import Path

import datasets
import pytest

from lit_memtrain.cli import main
from lit_memtrain.objectives.answer_accuracy import load_answer_prompts

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


def test_evaluate_scores_the_held_out_split_it_is_told_and_refuses_to_guess_among_several(tiny_gguf, tmp_path, capsys):
    rows = {name: [{"prompt": f"{name} question {i}", "answer": str(i)} for i in range(3)] for name in ("train", "test")}
    folder = str(tmp_path / "prompts")
    datasets.DatasetDict({name: datasets.Dataset.from_list(r) for name, r in rows.items()}).save_to_disk(folder)
    with pytest.raises(SystemExit):  # the first rows of "train" were scored: prompts the model trained on
        main(["evaluate", "--model", str(tiny_gguf), "--dataset", folder, "--num_prompts=2", "--max_new_tokens=1"])
    assert "has the splits ['train', 'test']: name the held-out one to score" in capsys.readouterr().err
    assert load_answer_prompts(folder, 2, "test") == rows["test"][:2]
    main(["evaluate", "--model", str(tiny_gguf), "--dataset", folder, "--split", "test", "--num_prompts=2",
          "--max_new_tokens=1"])  # fmt: skip
    assert re.search(rf"on 2 prompts of {folder} \(test\): \d/2", capsys.readouterr().out)
    with pytest.raises(ValueError, match=r"has no split 'validation'; its splits: \['train', 'test'\]"):
        load_answer_prompts(folder, 2, "validation")


def test_a_resumed_fit_scores_the_resumed_model_at_the_step_it_resumes_from(tmp_path, monkeypatch, info_lines):
    """Lightning restores the weights before on_fit_start and the step count after it: the first score of a resumed
    fit was the resumed model's, said to be "before training (step 0)" and logged at step 0."""
    monkeypatch.chdir(tmp_path)
    every_step = ("--trainer.callbacks+={class_path: lightning.pytorch.callbacks.ModelCheckpoint, "
                  "init_args: {every_n_train_steps: 1, save_last: true}}")  # fmt: skip
    scored = ["--trainer.callbacks+=lit_memtrain.callbacks.ExactAnswerAccuracy", "--trainer.callbacks.num_prompts=3",
              "--trainer.callbacks.max_new_tokens=2"]  # fmt: skip

    def fit(steps: int, *extra: str) -> None:
        main([
            "fit", "--config", QUICKSTART, SMALL, f"--trainer.max_steps={steps}", "--trainer.limit_val_batches=0",
            "--trainer.enable_progress_bar=false", "--data.batch_size=2", "--data.val_size=0", "--trainer.logger=false",
            f"--trainer.default_root_dir={tmp_path}", "--model.export_dir=null", "--trainer.enable_checkpointing=true",
            every_step, *extra,
        ])  # fmt: skip

    fit(2)
    fit(4, "--ckpt_path", "last", *scored)
    text = "\n".join(info_lines)
    assert re.search(r"exact-answer accuracy at the start of the resumed fit \(step 2\): \d/3", text), text
    assert re.search(r"exact-answer accuracy after training \(step 4\): \d/3", text)
    assert re.search(r"on 3 prompts of lit-memtrain/addition-heldout: \d/3 \(.*\) at step 2 -> \d/3 .* after 4 steps",
                     text)  # fmt: skip
    assert "(step 0)" not in text


def test_evaluate_scores_the_prompts_a_fit_held_out_of_its_training_split(tiny_gguf, capsys):
    """A GRPO fit on addition-prompts with val_size=40 trains on the other 1,960; the first rows of the split, which
    evaluate scored, are among those it trained on."""
    from lit_memtrain.datamodules.embedded import ADDITION_PROMPTS, EMBEDDED
    from lit_memtrain.datamodules.prompts import PromptDataModule

    data = PromptDataModule(tokenizer=EMBEDDED, dataset=ADDITION_PROMPTS, val_size=40, seed=7)
    data.setup("fit")
    trained = {json.dumps(prompt) for prompt in data.train_dataset["prompt"]}
    rows = load_answer_prompts(ADDITION_PROMPTS, 5, val_size=40, seed=7)
    assert [row["prompt"] for row in rows] == data.val_dataset["prompt"][:5]
    assert [row["answer"] for row in rows] == [str(answer) for answer in data.val_dataset["answer"][:5]]
    assert not {json.dumps(row["prompt"]) for row in rows} & trained
    assert {json.dumps(row["prompt"]) for row in load_answer_prompts(ADDITION_PROMPTS, 5)} <= trained
    main(["evaluate", "--model", str(tiny_gguf), "--dataset", ADDITION_PROMPTS, "--val_size=40", "--seed=7",
          "--num_prompts=2", "--max_new_tokens=1"])  # fmt: skip
    assert re.search(r"on 2 prompts of lit-memtrain/addition-prompts \(held out with val_size=40, seed=7\): \d/2",
                     capsys.readouterr().out)  # fmt: skip
