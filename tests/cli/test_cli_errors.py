"""Configuration mistakes end every subcommand in one line, ``lit-memtrain <command>: error: <message>``, with exit
status 2; a crash once batches run keeps its traceback; ``LIT_MEMTRAIN_TRACEBACK=1`` shows it for mistakes too."""

from pathlib import Path

import pytest
from lightning.pytorch import Callback

from lit_memtrain.cli import main
from lit_memtrain.cli.errors import TRACEBACK_VARIABLE
from lit_memtrain.models.presets import PRESETS

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = str(ROOT / "configs" / "quickstart.yaml")
DPO_CONFIG = str(ROOT / "configs" / "dpo.yaml")
SMALL = "--model.config_overrides={hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, head_dim: 8}"


@pytest.fixture
def fit(tmp_path, monkeypatch):
    """``lit-memtrain fit`` on the quickstart config, run in ``tmp_path``, without W&B."""
    monkeypatch.chdir(tmp_path)
    return ["fit", "--config", QUICKSTART, "--trainer.logger=false", f"--trainer.default_root_dir={tmp_path}"]


def one_line_error(args: list[str], capsys) -> str:
    """The error line of a command that must exit with status 2 and no traceback."""
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--data.max_length", "0"], "max_length must be at least 1 token, got 0."),
        (["--model.preset", "nosuch"], f"Unknown model preset 'nosuch'. Known presets: {', '.join(sorted(PRESETS))}."),
        (
            ["--trainer.callbacks+=lit_memtrain.callbacks.GradientCheckpointing", "--trainer.callbacks.selectiv=true"],
            "trainer.callbacks: lit_memtrain.callbacks.GradientCheckpointing takes no argument 'selectiv' "
            "(did you mean 'selective'?)",
        ),
        (
            ["--trainer.callbacks+=lit_memtrain.callbacks.GradientCheckpointin"],
            "trainer.callbacks: lit_memtrain.callbacks has no 'GradientCheckpointin' (did you mean "
            "'GradientCheckpointing'?)",
        ),
        (["--data.max_lenght", "3"], "unknown option --data.max_lenght (did you mean '--data.max_length'?)"),
        (["--data.max_length", "abc"], "data.max_length: expected int, got 'abc'"),
        (
            ["--trainer.accelerator=cpu", "--trainer.devices=0"],
            "`Trainer(devices='0')` value is not a valid input using cpu accelerator.",
        ),
    ],
    ids=["value", "preset", "callback-argument", "callback-class", "unknown-key", "wrong-type", "lightning"],
)
def test_fit_configuration_mistakes_end_in_one_line(fit, args, message, capsys):
    assert one_line_error([*fit, *args], capsys) == f"lit-memtrain fit: error: {message}"


def test_a_mistyped_key_in_a_config_file_gets_a_suggestion(fit, tmp_path, capsys):
    config = tmp_path / "typo.yaml"
    config.write_text("model:\n  lerning_rate: 0.1\n")
    error = one_line_error([*fit, "--config", str(config)], capsys)
    assert error == (
        "lit-memtrain fit: error: unknown key 'model.lerning_rate' in the configuration "
        "(did you mean 'model.learning_rate'?)"
    )


def test_a_mistyped_argument_of_a_class_a_config_names_gets_a_suggestion(tmp_path, capsys):
    error = one_line_error(["fit", "--config", DPO_CONFIG, "--model.bta=0.2"], capsys)
    assert error == (
        "lit-memtrain fit: error: model: lit_memtrain.DPOModule takes no argument 'bta' (did you mean 'beta'?)"
    )


def test_a_trl_field_grpo_does_not_take_gets_its_reason_not_a_suggestion(capsys):
    grpo = str(ROOT / "configs" / "grpo.yaml")
    error = one_line_error(["fit", "--config", grpo, "--model.per_device_train_batch_size=8"], capsys)
    assert error == (
        "lit-memtrain fit: error: model: GRPOModule has no per_device_train_batch_size (a TrainingArguments field of "
        "GRPOConfig and RLOOConfig of TRL 1.16): use PromptDataModule(batch_size=...) (counts prompts (each rank "
        "draws num_generations completions of each): TRL's counts completions)."
    )


def test_a_missing_local_dataset_is_named_as_a_missing_file(fit, tmp_path, capsys):
    error = one_line_error([*fit, "--data.dataset", "my_chats.jsonl"], capsys)
    assert error == (
        f"lit-memtrain fit: error: dataset 'my_chats.jsonl': no such file ({tmp_path / 'my_chats.jsonl'} does not "
        "exist). Check the path, relative to the directory the command runs in."
    )


def test_data_whose_columns_match_no_format_ends_in_one_line_during_set_up(fit, tmp_path, capsys):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"foo": "a", "baz": 1}\n' * 10)
    error = one_line_error([*fit, f"--data.dataset={data}", "--data.val_size=2"], capsys)
    assert error.startswith(f"lit-memtrain fit: error: The train split (from {data}): Cannot tell the dataset format")
    assert "from its columns ['foo', 'baz']. Supported formats: text: column(s) text;" in error


def test_padded_batches_under_context_parallelism_are_refused_before_the_ranks_start(fit, capsys):
    args = [
        "--trainer.strategy=lit_memtrain.strategies.ContextParallelStrategy",
        "--trainer.strategy.context_parallel_size=2",
        "--trainer.strategy.start_method=fork",  # were the check missed: ranks failing apart, not pytest relaunched
        "--trainer.devices=2",
        "--trainer.accelerator=cpu",
    ]
    assert one_line_error([*fit, *args], capsys) == (
        "lit-memtrain fit: error: ContextParallelStrategy splits each row over 2 ranks and needs padding-free batches "
        "(one row, documents kept apart by their positions), but SFTDataModule pads its batches (padding_free=False): "
        "set padding_free=True (--data.padding_free true) or packing=True (--data.packing true)."
    )


class FailsOnFirstBatch(Callback):
    def on_train_batch_start(self, *args) -> None:
        raise ValueError("a bug in the training step")


def test_a_crash_once_batches_run_keeps_its_traceback(fit, capsys):
    args = [
        f"--trainer.callbacks+={__name__}.FailsOnFirstBatch", "--trainer.max_steps=1",
        "--trainer.num_sanity_val_steps=0", "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false", SMALL,
    ]  # fmt: skip
    with pytest.raises(ValueError, match="a bug in the training step"):
        main([*fit, *args])
    assert "error:" not in capsys.readouterr().err


def test_the_traceback_variable_shows_a_configuration_error_whole(fit, monkeypatch):
    monkeypatch.setenv(TRACEBACK_VARIABLE, "1")
    with pytest.raises(ValueError, match="max_length must be at least 1 token, got 0"):
        main([*fit, "--data.max_length", "0"])


def test_plan_ends_a_parse_error_in_one_line(preloaded_python):
    """In a process of its own: a plan registers its stand-in device in the process it runs in."""
    selectiv = ["--trainer.callbacks+=lit_memtrain.callbacks.GradientCheckpointing", "--trainer.callbacks.selectiv=1"]
    result = preloaded_python.run("-m", "lit_memtrain.cli", "plan", "--config", QUICKSTART, *selectiv)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "lit-memtrain plan: error: trainer.callbacks: lit_memtrain.callbacks.GradientCheckpointing takes no argument "
        "'selectiv' (did you mean 'selective'?)"
    )


def test_the_other_subcommands_end_configuration_mistakes_in_one_line(tmp_path, capsys):
    assert one_line_error(["lengths", "--config", QUICKSTART, "--data.max_lenght=3"], capsys) == (
        "lit-memtrain lengths: error: unknown option --data.max_lenght (did you mean '--data.max_length'?)"
    )
    missing = tmp_path / "missing.ckpt"
    assert one_line_error(["export", "--checkpoint", str(missing), "--output", str(tmp_path / "out")], capsys) == (
        f"lit-memtrain export: error: [Errno 2] No such file or directory: '{missing}'"
    )
    assert one_line_error(["generate", "--model", str(tmp_path), "--prompt", "hi", "--temperature=-1"], capsys) == (
        "lit-memtrain generate: error: --temperature must be >= 0 and --top_p in (0, 1], got -1.0 and 1.0"
    )


def test_test_predict_and_unknown_subcommands_are_refused_with_what_to_run(capsys):
    assert one_line_error(["test", "--config", QUICKSTART], capsys) == (
        "lit-memtrain test: error: lit-memtrain has no test subcommand: the modules define no test_step; measure "
        "held-out data with `lit-memtrain validate` (its validation split: --data.val_split or --data.val_size)."
    )
    assert one_line_error(["predict"], capsys).startswith(
        "lit-memtrain predict: error: lit-memtrain has no predict subcommand: the modules define no predict_step; "
    )
    assert one_line_error(["fitt", "--config", QUICKSTART], capsys) == (
        "lit-memtrain: error: unknown subcommand 'fitt' (did you mean 'fit'?); choose from fit, validate, generate, "
        "evaluate, export, lengths, plan, curves."
    )


def test_a_config_file_that_is_missing_or_not_yaml_ends_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert one_line_error(["fit", "--config", "nope.yaml"], capsys) == (
        f"lit-memtrain fit: error: config: File does not exist: '{tmp_path / 'nope.yaml'}'"
    )
    (tmp_path / "broken.yaml").write_text("model:\n  preset: [tiny\n")
    assert one_line_error(["fit", "--config", "broken.yaml"], capsys).startswith(
        "lit-memtrain fit: error: Problems parsing config: while parsing a flow sequence"
    )
