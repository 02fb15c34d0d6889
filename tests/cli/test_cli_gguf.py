"""A GGUF model through every subcommand that names a model: fit (its tokenizer read from the file, the export loads
as a Hugging Face directory), generate, plan and lengths; and the one-line errors of a file that cannot be read."""

from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from lit_memtrain.cli import main

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = str(ROOT / "configs" / "quickstart.yaml")


def test_fit_trains_a_gguf_model_with_its_own_tokenizer_and_exports_it(tiny_gguf, tmp_path, monkeypatch, capsys,
                                                                       info_lines):  # fmt: skip
    monkeypatch.chdir(tmp_path)
    main([
        "fit", "--config", QUICKSTART, "--trainer.logger=false", "--trainer.max_steps=3",
        "--trainer.val_check_interval=3", "--trainer.limit_val_batches=1", "--trainer.enable_progress_bar=false",
        f"--model.model={tiny_gguf}", f"--model.export_dir={tmp_path / 'export'}", "--data.batch_size=4",
    ])  # fmt: skip
    assert f"data.tokenizer: the tokenizer of the GGUF model {tiny_gguf} (in place of the embedded " in "\n".join(
        info_lines
    )
    assert "train loss: first" in capsys.readouterr().out
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    assert exported.config.model_type == "llama" and exported.config.tie_word_embeddings
    assert AutoTokenizer.from_pretrained(tmp_path / "export").eos_token == "<|im_end|>"


def test_export_writes_a_checkpoint_of_a_gguf_model_as_a_hugging_face_directory(tiny_gguf, tmp_path, monkeypatch,
                                                                                  capsys):  # fmt: skip
    monkeypatch.chdir(tmp_path)
    main([
        "fit", "--config", QUICKSTART, "--trainer.logger=false", "--trainer.max_steps=1",
        "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false", "--trainer.enable_checkpointing=true",
        "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint", f"--trainer.callbacks.dirpath={tmp_path}",
        "--trainer.callbacks.filename=last", "--trainer.callbacks.every_n_train_steps=1",
        f"--model.model={tiny_gguf}", "--model.export_dir=null", "--data.batch_size=2",
    ])  # fmt: skip
    main(["export", "--checkpoint", str(tmp_path / "last.ckpt"), "--output", str(tmp_path / "export")])
    assert "(CausalLMModule)" in capsys.readouterr().out
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    assert getattr(exported.config, "quantization_config", None) is None
    assert AutoTokenizer.from_pretrained(tmp_path / "export").chat_template


def test_generate_answers_with_a_gguf_file(tiny_gguf, capsys):
    main(["generate", "--model", str(tiny_gguf), "--prompt", "What is 1 + 2?", "--max_new_tokens=3"])
    main(["generate", "--model", str(tiny_gguf.parent), "--gguf_file", tiny_gguf.name, "--prompt", "Hi",
          "--max_new_tokens=3"])  # fmt: skip
    out = capsys.readouterr().out
    assert out.count("answer: ") == 2 and "prompt: What is 1 + 2?" in out


def test_lengths_reads_the_gguf_models_tokenizer(tiny_gguf, tmp_path, capsys):
    main(["lengths", "--config", QUICKSTART, f"--model.model={tiny_gguf}", f"--histogram={tmp_path / 'h.png'}"])
    assert f"data.tokenizer: the tokenizer of the GGUF model {tiny_gguf}" in capsys.readouterr().out


def test_plan_reads_the_shape_of_a_gguf_model(tiny_gguf, preloaded_python):
    """In a process of its own: a plan registers its stand-in device in the process it runs in."""
    result = preloaded_python.run(
        "-m", "lit_memtrain.cli", "plan", "--config", QUICKSTART, f"--model.model={tiny_gguf}"
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert f"Model: {tiny_gguf}, 0.11M parameters (0.11M trainable), 2 decoder layers, vocabulary 384" in result.stdout


@pytest.mark.parametrize("command", ["fit", "generate"])
def test_a_missing_gguf_file_ends_in_one_line(command, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    missing = tmp_path / "nosuch.gguf"
    if command == "fit":
        args = ["fit", "--config", QUICKSTART, "--trainer.logger=false", f"--model.model={missing}"]
    else:
        args = ["generate", "--model", str(missing), "--prompt", "Hi"]
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1] == f"lit-memtrain {command}: error: GGUF file '{missing}' does not exist."


def test_the_smollm2_config_reads_a_gguf_model_and_its_tokenizer(tiny_gguf):
    from lit_memtrain.callbacks import ExactAnswerAccuracy
    from lit_memtrain.cli import MemTrainCLI
    from lit_memtrain.datamodules.sft import SFTDataModule
    from lit_memtrain.objectives.causal_lm import CausalLMModule

    config = str(ROOT / "configs" / "smollm2_sft.yaml")
    args = ["--config", config, f"--model.model={tiny_gguf}", "--trainer.logger=false"]
    cli = MemTrainCLI(CausalLMModule, SFTDataModule, args=args, run=False)
    assert cli.datamodule.tokenizer_name == cli.model.hparams.tokenizer == str(tiny_gguf)
    assert cli.datamodule.dataset == "lit-memtrain/addition" and cli.datamodule.assistant_only_loss
    (accuracy,) = [c for c in cli.trainer.callbacks if isinstance(c, ExactAnswerAccuracy)]
    assert accuracy.num_prompts >= 100 and accuracy.dataset == "lit-memtrain/addition-heldout"


def test_the_smollm2_grpo_config_starts_from_a_20_step_sft_export_with_an_exact_answer_reward():
    import yaml

    from lit_memtrain.objectives.arithmetic_rewards import exact_answer

    config = yaml.safe_load((ROOT / "configs" / "smollm2_grpo.yaml").read_text())
    sft = yaml.safe_load((ROOT / "configs" / "smollm2_sft.yaml").read_text())
    make = (ROOT / "Makefile").read_text()
    model, data = config["model"]["init_args"], config["data"]["init_args"]
    assert sft["model"]["export_dir"].replace("smollm2_sft", "smollm2_sft20") == model["model"] == data["tokenizer"]
    assert f"--model.export_dir={model['model']}" in make and "--trainer.max_steps=20" in make
    assert model["reward_funcs"] == [f"{exact_answer.__module__}.exact_answer"]
    assert data["dataset"] == "lit-memtrain/addition-prompts"
    (accuracy,) = config["trainer"]["callbacks"]
    assert accuracy["init_args"]["num_prompts"] >= 100
