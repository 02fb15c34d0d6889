"""MemoryPlanCheck: the plan runs in setup, before configure_model builds the model, through a real Trainer."""

from __future__ import annotations

import warnings

import pytest
from lightning.pytorch import Trainer

from lit_memtrain import CausalLMModule, SFTDataModule
from lit_memtrain.callbacks import MemoryPlanCheck

TINY = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}


class RecordingModule(CausalLMModule):
    """Records, when the model is built, whether a plan had been made by then."""

    def __init__(self, check: MemoryPlanCheck, **kwargs) -> None:
        super().__init__(**kwargs)
        self.check = check
        self.planned_before_build: bool | None = None

    def configure_model(self) -> None:
        if self.planned_before_build is None:
            self.planned_before_build = self.check.plan is not None
        super().configure_model()


class OwnLoss(RecordingModule):
    """Trains with a loss of its own, which the planner cannot know."""

    def compute_loss(self, batch, num_items=None):
        return 2 * super().compute_loss(batch, num_items)


def _fit(check: MemoryPlanCheck, module_class: type[RecordingModule] = RecordingModule) -> RecordingModule:
    # The plain loss without checkpointing at 8,192 tokens needs ~70 MiB; with checkpointing ~30 MiB.
    module = module_class(check, preset="tiny-qwen3", config_overrides=TINY, loss_type="nll",
                          tokenizer="lit-memtrain/embedded")  # fmt: skip
    trainer = Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=[check])  # fmt: skip
    trainer.fit(module, datamodule=SFTDataModule(max_length=8192, batch_size=1))
    return module


def test_warns_before_the_model_is_built_and_says_what_to_add():
    check = MemoryPlanCheck(gpu_memory_gib=0.06)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = _fit(check)
    messages = [str(warning.message) for warning in caught if "will not fit in GPU memory" in str(warning.message)]
    assert len(messages) == 1
    assert "To fit, add: gradient checkpointing (callback lit_memtrain.callbacks.GradientCheckpointing)" in messages[0]
    assert module.planned_before_build is True
    assert check.plan["fits"] is False and check.plan["sequence_length"] == 8192
    assert check.plan["usable_bytes"] == int(0.06 * 2**30 * 0.9)


def test_stop_raises_before_the_model_is_built():
    check = MemoryPlanCheck(gpu_memory_gib=0.06, stop=True)
    with pytest.raises(RuntimeError, match="MemoryPlanCheck stopped the fit before the model was built"):
        module = _fit(check)
    assert check.plan is not None and not check.plan["fits"]


def test_a_fit_the_planner_refuses_is_skipped_with_its_reason():
    """The planner (a child process, which imports this module's classes as the fit does) refuses a module that
    overrides the step; the callback says why and the fit goes on."""
    check = MemoryPlanCheck(gpu_memory_gib=0.06, stop=True)
    with pytest.warns(UserWarning, match="MemoryPlanCheck cannot plan this fit, skipped: model.class_path is .*OwnLoss"):
        module = _fit(check, OwnLoss)
    assert check.plan is None and module.model is not None


def test_skipped_without_a_gpu_size_on_the_cpu():
    check = MemoryPlanCheck()
    module = _fit(check)
    assert check.plan is None and module.model is not None


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"gpu_memory_gib": 0}, "gpu_memory_gib must be positive"),
        ({"margin": 1.0}, "margin is a fraction of the GPU memory"),
        ({"timeout": 0}, "timeout must be a positive number of seconds"),
    ],
)
def test_invalid_arguments_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MemoryPlanCheck(**kwargs)
