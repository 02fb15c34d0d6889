"""The planner's Online DPO step: a pair per prompt generated (``max_new_tokens`` each), then one training slice of
every completion, the frozen reference held in both phases; and MemoryPlanCheck planning an Online DPO fit."""

from __future__ import annotations

import datasets
from lightning.pytorch import Trainer
from tiny_models import TINY_OVERRIDES

from lit_memtrain.callbacks import MemoryPlanCheck
from lit_memtrain.datamodules.prompts import PromptDataModule
from lit_memtrain.models.lora import LoraSettings
from lit_memtrain.objectives.online_dpo import OnlineDPOModule
from lit_memtrain.planner.fit_config import settings_from_config
from lit_memtrain.planner.generation import GenerationPlan
from lit_memtrain.planner.settings import CAUSAL_LM_MODULE



def _config(**model) -> dict:
    return {
        "model": {"class_path": "lit_memtrain.OnlineDPOModule",
                  "init_args": {"preset": "tiny-qwen3", "config_overrides": TINY_OVERRIDES, "max_new_tokens": 100,
                                "reward_funcs": ["x.y"], **model}},
        "data": {"class_path": "lit_memtrain.datamodules.PromptDataModule",
                 "init_args": {"max_prompt_length": 28, "batch_size": 3}},
        "trainer": {"precision": "bf16-mixed"},
    }


def test_an_online_dpo_fit_is_planned_as_its_pairs_and_one_training_slice():
    settings = settings_from_config(_config(gradient_accumulation_steps=4, beta=[0.1, 0.05]))
    assert settings.module_class == CAUSAL_LM_MODULE
    assert (settings.max_length, settings.batch_size, settings.accumulate_grad_batches) == (128, 6, 4)
    assert settings.generation == GenerationPlan(prompts=3, num_generations=2, max_prompt_length=28,
                                                 max_completion_length=100, frozen_reference=True)
    with_lora = settings_from_config(_config(lora={"r": 4}))
    assert not with_lora.generation.frozen_reference  # the base model, its adapter disabled, is the reference


def test_memory_plan_check_plans_an_online_dpo_fit_with_its_generation_phase():
    """16 completions of 192 tokens generated, then trained together: the training slice is the peak."""
    module = OnlineDPOModule(preset="tiny-qwen3", config_overrides=TINY_OVERRIDES, tokenizer="lit-memtrain/embedded",
                             reward_funcs=[lambda completions, **kw: [0.0] * len(completions)], max_new_tokens=128,
                             max_length=192, lora=LoraSettings(r=4, alpha=8))
    check = MemoryPlanCheck(gpu_memory_gib=1.0)
    trainer = Trainer(max_steps=0, accelerator="cpu", logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=[check])
    prompts = datasets.Dataset.from_list([{"prompt": f"{i} plus {i}"} for i in range(4)])
    trainer.fit(module, datamodule=PromptDataModule(dataset=prompts, batch_size=8, max_prompt_length=64,
                                                    drop_last=False))  # 4 prompts: a batch of 8 plans, trains none
    planned = "transformers generation of 8 prompts x 2 completions (64 + 128 tokens) before training on 16 completions"
    assert any(planned in note and "kv_cache" in note for note in check.plan["notes"]), check.plan["notes"]
    assert check.plan["phase"] != "generation (transformers)"  # 16 sequences of 192 tokens trained at once
