"""Reading fit configurations into plan settings: the same parser as `lit-memtrain fit`, nothing instantiated."""

from __future__ import annotations

import pytest

from lit_memtrain.callbacks import ActivationOffloading, GradientCheckpointing, TiledMLP
from lit_memtrain.planner.fit_config import read_fit_config, strategy_spec
from lit_memtrain.planner.settings import PlanSettings, normalise_precision
from lit_memtrain.planner.techniques import Techniques, techniques_of, with_techniques


def test_a_gpu_config_with_a_hub_model_is_read_without_loading_anything():
    """configs/long_context.yaml names accelerator gpu, flash-attn and a hub model and tokenizer: none of
    them is needed to read it."""
    settings = read_fit_config(["--config", "configs/long_context.yaml", "--data.max_length=262144"])
    assert settings.module["model"] == "Qwen/Qwen3-4B"
    assert settings.module["loss_type"] == "chunked" and settings.module["loss_chunk_size"] == 4096
    assert settings.module["model_init_kwargs"]["rope_parameters"]["rope_type"] == "yarn"
    assert (settings.precision, settings.max_length, settings.batch_size) == ("32-true", 262144, 1)  # FSDP2 computes in bf16
    assert settings.padding_free and settings.accumulate_grad_batches == 4
    assert settings.tokenizer == "Qwen/Qwen3-4B"
    assert techniques_of(settings) == Techniques("selective_offload", chunked_loss=True, tiled_mlp=True, cpu_offload=True)
    assert (settings.strategy.kind, settings.strategy.mixed_precision) == ("fsdp2", "bf16")


def test_overrides_compose_as_in_fit():
    settings = read_fit_config([
        "--config", "configs/quickstart.yaml", "--trainer.callbacks+=lit_memtrain.callbacks.ActivationOffloading",
        "--trainer.precision", "bf16-true", "--model.loss_type=nll", "--data.batch_size=2", "--data.packing=true",
    ])  # fmt: skip
    assert settings.precision == "bf16-true" and settings.batch_size == 2 and settings.padding_free
    assert techniques_of(settings) == Techniques("full", chunked_loss=False, activation_offloading=True)
    assert settings.callback(ActivationOffloading).init_args["max_fwd_stash_size"] == 5


def test_switching_techniques_keeps_the_rest_of_the_configuration():
    settings = read_fit_config(["--config", "configs/long_context.yaml"])
    plain = with_techniques(settings, Techniques())
    assert techniques_of(plain) == Techniques() and plain.module["loss_type"] == "nll"
    assert [spec.name for spec in plain.callbacks] == ["MemoryMonitor", "PositionalLoss"]
    again = with_techniques(plain, Techniques("offload", chunked_loss=True, tiled_mlp=True))
    assert again.callback(GradientCheckpointing).init_args == {"selective": False, "offload": True}
    assert again.callback(TiledMLP) is not None and again.module == settings.module
    assert PlanSettings.from_dict(again.to_dict()) == again


@pytest.mark.parametrize(
    ("strategy", "devices", "num_nodes", "expected"),
    [
        (None, 1, None, ("auto", 1, "single_device")),
        ("auto", 4, None, ("auto", 4, "ddp")),
        ("ddp_fork", "0,1", 2, ("ddp_fork", 4, "ddp")),
        ({"class_path": "lightning.pytorch.strategies.DDPStrategy"}, [0, 1], None, ("DDPStrategy", 2, "ddp")),
        ("fsdp", 8, None, ("fsdp", 8, "not_simulated")),
        ({"class_path": "lightning.pytorch.strategies.ModelParallelStrategy"}, 2, None,
         ("ModelParallelStrategy", 2, "not_simulated")),
    ],
)  # fmt: skip
def test_strategies(strategy, devices, num_nodes, expected):
    spec = strategy_spec(strategy, devices, num_nodes)
    assert (spec.name, spec.world_size, spec.kind) == expected


def test_precisions():
    assert [normalise_precision(p) for p in (None, 32, "bf16", 16, "bf16-true")] == [
        "32-true", "32-true", "bf16-mixed", "16-mixed", "bf16-true",
    ]  # fmt: skip
    with pytest.raises(ValueError, match="cannot simulate trainer.precision='transformer-engine'"):
        normalise_precision("transformer-engine")


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"module": {"loss_type": "chunked"}}, "The configuration has no model: set model.model"),
        ({"max_length": 0}, "data.max_length must be at least 1 token, got 0"),
        ({"batch_size": 0}, "data.batch_size and trainer.accumulate_grad_batches must be at least 1"),
    ],
)
def test_settings_refuse_what_cannot_be_planned(changes, message):
    with pytest.raises(ValueError, match=message):
        PlanSettings(**{"module": {"preset": "tiny-qwen3"}, **changes})
