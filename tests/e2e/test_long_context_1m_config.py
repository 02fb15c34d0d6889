"""configs/long_context_1m.yaml parses and builds (with an offline tiny model standing in for Qwen3-8B), and its
settings fit the model it names: Qwen3-8B's heads split over 8 ranks, YaRN reaching the row length."""

from pathlib import Path

import torch
import yaml

from lit_memtrain.cli import MemTrainCLI
from lit_memtrain.parallel.context_parallel import check_context_parallel
from lit_memtrain.datamodules.sft import SFTDataModule
from lit_memtrain.objectives.causal_lm import CausalLMModule
from lit_memtrain.models.presets import build_config
from lit_memtrain.strategies import ContextParallelStrategy

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "long_context_1m.yaml"
OFFLINE = [
    "--model.model=null", "--model.preset=tiny-qwen3", "--data.tokenizer=lit-memtrain/embedded",
    "--model.attn_implementation=sdpa_by_document", "--trainer.accelerator=cpu",
    "--trainer.strategy.init_args.inner=sdpa_by_document",  # flash-attn is not installed here
]  # fmt: skip


def test_the_million_token_config_parses_and_builds_with_an_offline_model():
    cli = MemTrainCLI(CausalLMModule, SFTDataModule, args=["--config", str(CONFIG), *OFFLINE], run=False)
    strategy = cli.trainer.strategy
    assert isinstance(strategy, ContextParallelStrategy)
    assert (strategy.method, strategy.context_parallel_size, strategy.mp_policy.param_dtype) == ("ulysses", 8, torch.bfloat16)
    assert strategy.mesh_shape() == {"data_parallel": 1, "context_parallel": 8}
    names = [type(c).__name__ for c in cli.trainer.callbacks]
    assert {"GradientCheckpointing", "TiledMLP", "PositionalLoss"} <= set(names)
    assert cli.datamodule.packing and cli.datamodule.max_length == 1_048_576
    assert cli.model.hparams.loss_type == "chunked"
    cli.model.configure_model()
    assert cli.model.model.config.rope_parameters["rope_type"] == "yarn"


def test_the_million_token_settings_fit_qwen3_8b():
    settings = yaml.safe_load(CONFIG.read_text())
    strategy = settings["trainer"]["strategy"]["init_args"]
    assert settings["model"]["model"] == "Qwen/Qwen3-8B"
    check_context_parallel(build_config("qwen3-8b"), strategy["context_parallel_size"], strategy["method"], 8)
    rope = settings["model"]["model_init_kwargs"]["rope_parameters"]
    assert rope["factor"] * rope["original_max_position_embeddings"] == settings["data"]["max_length"] == 1_048_576
    assert settings["trainer"]["callbacks"][0]["init_args"] == {"offload": True}  # offloaded checkpoints
