"""A strategy named by its import path alone, on the command line or in a config, is that class, as the plan reads
it (jsonargparse reads a lone path as a string, which Lightning refused as an unknown strategy name)."""

from pathlib import Path

import pytest
from lightning.pytorch.strategies import DDPStrategy

from lit_memtrain.cli import MemTrainCLI
from lit_memtrain.datamodules.sft import SFTDataModule
from lit_memtrain.objectives.causal_lm import CausalLMModule
from lit_memtrain.strategies import FSDP2Strategy

QUICKSTART = str(Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml")


def _trainer(*args: str):
    cli = MemTrainCLI(CausalLMModule, SFTDataModule, run=False,
                      args=["--config", QUICKSTART, "--trainer.logger=false", "--trainer.accelerator=cpu", *args])
    return cli.trainer


def test_a_strategy_given_by_its_import_path_alone_on_the_command_line_is_that_class():
    assert isinstance(_trainer("--trainer.strategy=lit_memtrain.strategies.FSDP2Strategy").strategy, FSDP2Strategy)
    strategy = _trainer("--trainer.strategy=lit_memtrain.strategies.FSDP2Strategy",
                        "--trainer.strategy.cpu_offload=true").strategy  # with an option it always was
    assert isinstance(strategy, FSDP2Strategy) and strategy.cpu_offload


def test_a_strategy_given_by_its_import_path_alone_in_a_config_is_that_class(tmp_path):
    config = tmp_path / "strategy.yaml"
    config.write_text("trainer:\n  strategy: lit_memtrain.strategies.FSDP2Strategy\n")
    assert isinstance(_trainer("--config", str(config)).strategy, FSDP2Strategy)


def test_registered_names_and_unknown_paths_are_left_to_lightning():
    assert isinstance(_trainer("--trainer.strategy=ddp").strategy, DDPStrategy)
    with pytest.raises(ValueError, match="invalid strategy name"):
        _trainer("--trainer.strategy=my_project.strategies.Missing")
