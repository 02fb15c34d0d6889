"""The model named last among the config files and ``--model.*`` arguments wins, with the config_overrides given with
or after it; what it replaces is logged; one source naming two stays an error."""

from pathlib import Path

import pytest
from lightning.pytorch import LightningDataModule
from transformers import AutoConfig, AutoModelForCausalLM

from lit_memtrain.cli import MemTrainCLI, main
from lit_memtrain.datamodules.sft import SFTDataModule
from lit_memtrain.models.presets import build_config
from lit_memtrain.objectives.causal_lm import CausalLMModule
from lit_memtrain.objectives.dpo import DPOModule

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = str(ROOT / "configs" / "quickstart.yaml")
DPO_CONFIG = str(ROOT / "configs" / "dpo.yaml")
QUICKSTART_OVERRIDES = (
    "{'hidden_size': 128, 'intermediate_size': 384, 'num_hidden_layers': 4, 'num_attention_heads': 4, "
    "'num_key_value_heads': 2, 'head_dim': 32}"
)


@pytest.fixture
def my_model(tmp_path, tokenizer):
    """A user's own model directory, with the tokenizer it was trained with: 3 layers of 48, unlike the quickstart's
    preset (4 layers of 128)."""
    config = build_config("tiny-qwen3", {"hidden_size": 48, "intermediate_size": 96, "num_hidden_layers": 3})
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "my_model")
    tokenizer.save_pretrained(tmp_path / "my_model")
    return str(tmp_path / "my_model")


def parsed(args: list[str], by_class_path: bool = False) -> MemTrainCLI:
    return MemTrainCLI(
        CausalLMModule,
        LightningDataModule if by_class_path else SFTDataModule,
        subclass_mode_model=by_class_path,
        subclass_mode_data=by_class_path,
        run=False,
        args=[*args, "--trainer.logger=false"],
    )


def test_a_model_on_the_command_line_replaces_the_configs_preset_and_trains(my_model, tmp_path, info_lines, capsys):
    export = tmp_path / "export"
    main([
        "fit", "--config", QUICKSTART, "--model.model", my_model, "--trainer.max_steps=1", "--trainer.logger=false",
        f"--trainer.default_root_dir={tmp_path}", "--trainer.num_sanity_val_steps=0", "--trainer.limit_val_batches=0",
        "--trainer.enable_progress_bar=false", f"--model.export_dir={export}",
    ])  # fmt: skip
    trained = AutoConfig.from_pretrained(export)
    assert (trained.num_hidden_layers, trained.hidden_size) == (3, 48)
    assert (
        f"model.model={my_model!r} from the command line is given last: it replaces model.preset='tiny-qwen3', "
        f"model.config_overrides={QUICKSTART_OVERRIDES} given before it."
    ) in info_lines


def test_a_model_on_the_command_line_replaces_the_preset_of_a_config_naming_its_classes(my_model, info_lines):
    cli = parsed(["--config", DPO_CONFIG, f"--model.model={my_model}"], by_class_path=True)
    assert isinstance(cli.model, DPOModule)
    recipe = cli.model.recipe
    assert (recipe.model, recipe.preset, recipe.config_overrides) == (my_model, None, None)
    assert any(line.startswith(f"model.model={my_model!r} from the command line is given last") for line in info_lines)


def test_overrides_given_with_or_after_the_winning_model_stay(my_model):
    cli = parsed(["--config", QUICKSTART, "--model.config_overrides={use_cache: false}", f"--model.model={my_model}"])
    assert (cli.model.recipe.model, cli.model.recipe.preset) == (my_model, None)
    assert cli.model.recipe.config_overrides == {"use_cache": False}


def test_a_config_given_after_the_command_line_model_wins(my_model, info_lines):
    cli = parsed([f"--model.model={my_model}", "--config", QUICKSTART])
    assert (cli.model.recipe.model, cli.model.recipe.preset) == (None, "tiny-qwen3")
    assert cli.model.recipe.config_overrides["hidden_size"] == 128
    assert (
        f"model.preset='tiny-qwen3' from --config {QUICKSTART} is given last: it replaces model.model={my_model!r} "
        "given before it."
    ) in info_lines


def test_nothing_is_replaced_when_only_one_model_is_named(info_lines):
    cli = parsed(["--config", QUICKSTART, "--model.learning_rate=0.01"])
    assert cli.model.recipe.preset == "tiny-qwen3" and cli.model.recipe.config_overrides["num_hidden_layers"] == 4
    assert not any("is given last" in line for line in info_lines)


def test_one_source_naming_two_models_stays_an_error(my_model, tmp_path, capsys):
    config = tmp_path / "two.yaml"
    config.write_text(f"model:\n  model: {my_model}\n  preset: tiny-qwen3\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", QUICKSTART, "--config", str(config), "--trainer.logger=false"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "lit-memtrain fit: error: Give exactly one of model (hub id or path), preset (one of lit_memtrain.PRESETS) or "
        "config (a dict with model_type); got ['model', 'preset']."
    )
