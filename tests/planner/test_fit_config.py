"""Reading fit configurations into plan settings: the same parser as `lit-memtrain fit`, nothing instantiated."""

from __future__ import annotations

import inspect
import json

import pytest
from lightning.pytorch import Trainer

from lit_memtrain.callbacks import ActivationOffloading, GradientCheckpointing, TiledMLP
from lit_memtrain.callbacks.live_fit import fit_config
from lit_memtrain.datamodules.preference import PreferenceDataModule
from lit_memtrain.datamodules.sft import SFTDataModule
from lit_memtrain.objectives.dpo import DPOModule
from lit_memtrain.objectives.causal_lm import CausalLMModule
from lit_memtrain.cli.plan import read_fit_config
from lit_memtrain.planner.fit_config import settings_from_config, strategy_spec
from lit_memtrain.planner.settings import CAUSAL_LM_MODULE, DPO_MODULE, PlanSettings, normalise_precision
from lit_memtrain.planner.techniques import Techniques, comparison_rows, techniques_of, with_techniques
from lit_memtrain.strategies import ContextParallelStrategy


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
    techniques = techniques_of(settings)
    assert techniques.describe() == (
        "selective checkpointing with offloaded inputs, chunked loss, tiled MLP, CPU-offloaded state"
    )
    assert techniques.callback(GradientCheckpointing).init_args == {"selective": True, "offload": True}
    assert (settings.strategy.kind, settings.strategy.mixed_precision) == ("fsdp2", "bf16")


def test_overrides_compose_as_in_fit():
    settings = read_fit_config([
        "--config", "configs/quickstart.yaml", "--trainer.callbacks+=lit_memtrain.callbacks.ActivationOffloading",
        "--trainer.precision", "bf16-true", "--model.loss_type=nll", "--data.batch_size=2", "--data.packing=true",
    ])  # fmt: skip
    assert settings.precision == "bf16-true" and settings.batch_size == 2 and settings.padding_free
    assert techniques_of(settings).describe() == "gradient checkpointing, activation offloading"
    assert settings.callback(ActivationOffloading).init_args["max_fwd_stash_size"] == 5


def test_switching_techniques_keeps_the_rest_of_the_configuration():
    settings = read_fit_config(["--config", "configs/long_context.yaml"])
    plain = with_techniques(settings, Techniques())
    assert techniques_of(plain) == Techniques() and plain.module["loss_type"] == "nll"
    assert [spec.name for spec in plain.callbacks] == ["MemoryMonitor", "PositionalLoss", "ModelCheckpoint"]
    offloaded = {name: techniques for name, techniques, _ in comparison_rows(settings)}["+ offloaded checkpoints"]
    again = with_techniques(plain, offloaded)
    assert offloaded.describe() == "checkpointing with offloaded inputs, chunked loss, tiled MLP"
    assert techniques_of(again) == offloaded
    assert again.callback(GradientCheckpointing).init_args == {"offload": True}  # selective: its default, False
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


def test_the_dpo_config_is_read_as_fit_reads_it():
    settings = read_fit_config(["--config", "configs/dpo.yaml", "--model.beta=0.3"])
    assert settings.module_class == DPO_MODULE and settings.preference
    assert settings.module["beta"] == 0.3 and settings.module["reference"] == "precomputed"
    assert (settings.max_length, settings.batch_size, settings.sequences, settings.padding_free) == (64, 16, 32, True)
    assert settings.tokens_per_step == 32 * 64 and settings.tokenizer == "lit-memtrain/embedded"
    assert PlanSettings.from_dict(settings.to_dict()) == settings


class _OwnLoss(CausalLMModule):
    def compute_loss(self, batch, num_items=None):
        return 2 * super().compute_loss(batch, num_items)


class _Logged(DPOModule):
    """Adds an argument, keeps DPOModule's step."""

    def __init__(self, note: str = "", **kwargs) -> None:
        super().__init__(**kwargs)


def test_a_live_fit_is_planned_by_its_module_class_and_unknown_steps_are_refused():
    """What MemoryPlanCheck hands the planner: the live fit as a config, planned by its module class; a subclass that
    keeps the step plans as its base, a DPO fit plans pairs."""
    trainer = Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False)
    pairs = PreferenceDataModule(max_length=128, batch_size=4)
    config = fit_config(trainer, _Logged(note="x", preset="tiny-qwen3", beta=0.2), pairs)
    json.dumps(config)  # what MemoryPlanCheck hands the planner's process
    settings = settings_from_config(config)
    assert settings.module_class == DPO_MODULE and settings.module["beta"] == 0.2 and "note" not in settings.module
    assert settings.sequences == 8 and settings.padding_free
    with pytest.raises(ValueError, match="DPOModule is planned on the batches of lit_memtrain.datamodules.preference"):
        settings_from_config(fit_config(trainer, DPOModule(preset="tiny-qwen3"), SFTDataModule(max_length=128)))
    with pytest.raises(ValueError, match="which overrides compute_loss of CausalLMModule: the planner simulates"):
        settings_from_config(fit_config(trainer, _OwnLoss(preset="tiny-qwen3"), SFTDataModule(max_length=128)))


def test_a_live_fit_of_classes_defined_in_the_training_script_is_planned_as_their_importable_base():
    """The planner's process cannot import ``__main__.X``: a script's subclass is described as its nearest importable
    base, with the methods the script adds, so a kept step is planned and a changed one still refused."""

    class KeepsTheStep(CausalLMModule):
        def on_train_end(self) -> None:
            super().on_train_end()

    class ChangesTheLoss(KeepsTheStep):
        def compute_loss(self, batch, num_items=None):
            return 2 * super().compute_loss(batch, num_items)

    for cls in (KeepsTheStep, ChangesTheLoss):
        cls.__module__ = "__main__"
    trainer = Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False)
    data = SFTDataModule(max_length=128)
    config = fit_config(trainer, KeepsTheStep(preset="tiny-qwen3"), data)
    assert config["model"]["class_path"] == CAUSAL_LM_MODULE and config["model"]["overridden_methods"] == ["on_train_end"]
    assert settings_from_config(config).module_class == CAUSAL_LM_MODULE
    config = fit_config(trainer, ChangesTheLoss(preset="tiny-qwen3"), data)
    assert config["model"]["overridden_methods"] == ["compute_loss", "on_train_end"]
    with pytest.raises(ValueError, match="overrides compute_loss of CausalLMModule"):
        settings_from_config(config)


def test_a_live_fit_is_described_as_its_config():
    """The trainer's precision, accumulation and callbacks (with the arguments they keep), the datamodule's and the
    module's arguments: the settings LightningCLI's parse of the same fit would give."""
    callbacks = [GradientCheckpointing(selective=True), ActivationOffloading(max_fwd_stash_size=2)]
    trainer = Trainer(accelerator="cpu", precision="bf16-mixed", accumulate_grad_batches=4, callbacks=callbacks,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False)  # fmt: skip
    module = CausalLMModule(preset="tiny-qwen3", tokenizer="lit-memtrain/embedded", loss_type="nll")
    data = SFTDataModule(max_length=4096, batch_size=2, packing=True)
    settings = settings_from_config(fit_config(trainer, module, data))
    assert settings.module_class == CAUSAL_LM_MODULE
    assert (settings.precision, settings.accumulate_grad_batches) == ("bf16-mixed", 4)
    assert (settings.max_length, settings.batch_size, settings.padding_free) == (4096, 2, True)
    assert settings.module["loss_type"] == "nll" and settings.tokenizer == "lit-memtrain/embedded"
    assert (settings.strategy.kind, settings.strategy.world_size) == ("single_device", 1)
    assert techniques_of(settings).describe() == "selective checkpointing, activation offloading"
    assert settings.callback(ActivationOffloading).init_args["max_fwd_stash_size"] == 2


def test_what_a_config_leaves_out_takes_the_defaults_of_the_classes_that_own_them():
    settings = settings_from_config({"model": {"preset": "tiny-qwen3"}})
    defaults = {name: p.default for name, p in inspect.signature(SFTDataModule).parameters.items()}
    assert (settings.max_length, settings.batch_size) == (defaults["max_length"], defaults["batch_size"])
    assert settings.tokenizer == defaults["tokenizer"] and not settings.padding_free
    assert (settings.precision, settings.accumulate_grad_batches) == ("32-true", 1)
    assert settings.strategy.kind == "single_device"
    dpo = {"class_path": "lit_memtrain.DPOModule", "init_args": {"preset": "tiny-qwen3"}}
    pairs = settings_from_config({"model": dpo, "data": {"class_path": "lit_memtrain.PreferenceDataModule"}})
    assert pairs.padding_free  # PreferenceDataModule's default
    split = strategy_spec({"class_path": "lit_memtrain.strategies.ContextParallelStrategy",
                           "init_args": {"context_parallel_size": 2}}, 4)  # fmt: skip
    method, backend = (inspect.signature(ContextParallelStrategy).parameters[name].default
                       for name in ("method", "ring_backend"))  # fmt: skip
    assert (split.context_parallel_method, split.ring_backend) == (method, backend)
