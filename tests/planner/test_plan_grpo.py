"""The planner's GRPO step: the training slice planned as an SFT step on the completions, the generation phase's KV
cache counted exactly per backend, the larger of the two as the plan's peak, and MemoryPlanCheck planning a GRPO
fit through the Trainer."""

from __future__ import annotations

import datasets
import pytest
from lightning.pytorch import Trainer

from lit_memtrain.callbacks import MemoryPlanCheck
from lit_memtrain.datamodules.prompts import PromptDataModule
from lit_memtrain.models.presets import build_config
from lit_memtrain.objectives.grpo import GRPOModule
from lit_memtrain.planner.fit_config import settings_from_config
from lit_memtrain.planner.generation import GenerationPlan, generation_bytes
from lit_memtrain.planner.settings import CAUSAL_LM_MODULE

OVERRIDES = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 16}


def _config(**model) -> dict:
    return {
        "model": {"class_path": "lit_memtrain.GRPOModule",
                  "init_args": {"preset": "tiny-qwen3", "config_overrides": OVERRIDES, "num_generations": 4,
                                "max_completion_length": 100, "reward_funcs": ["x.y"], **model}},
        "data": {"class_path": "lit_memtrain.datamodules.PromptDataModule",
                 "init_args": {"max_prompt_length": 28, "batch_size": 3}},
        "trainer": {"precision": "bf16-mixed"},
    }


def test_a_grpo_fit_is_planned_as_its_training_slice_and_its_generation():
    settings = settings_from_config(_config(steps_per_generation=2, gradient_accumulation_steps=2, beta=0.1))
    assert settings.module_class == CAUSAL_LM_MODULE
    assert (settings.max_length, settings.batch_size, settings.padding_free, settings.accumulate_grad_batches) == \
           (128, 6, True, 2)  # 3 prompts x 4 completions in 2 slices, prompt + completion tokens
    assert settings.generation == GenerationPlan(prompts=3, num_generations=4, max_prompt_length=28,
                                                 max_completion_length=100, frozen_reference=True)
    rloo = _config()
    rloo["model"]["class_path"] = "lit_memtrain.RLOOModule"
    assert settings_from_config(rloo).generation.completions == 12
    with pytest.raises(ValueError, match="cannot be split into steps_per_generation=5"):
        settings_from_config(_config(steps_per_generation=5))


def test_the_generation_phase_counts_the_kv_cache_of_every_completion():
    settings = settings_from_config(_config())
    config = build_config("tiny-qwen3", OVERRIDES)
    per_token_layer = 2 * 2 * 16 * 2  # K and V, 2 KV heads of 16, bf16 under bf16-mixed
    parts = generation_bytes(settings, settings.generation, config, 10**6, 80 * 2**30)
    assert parts["kv_cache"] == 12 * 128 * per_token_layer * (2 + 1)  # every layer, and one more while it grows
    assert parts["prefill_transients"] == 3 * 12 * 28 * 128 * 2 and parts["logits"] == 12 * config.vocab_size * 8
    paged = generation_bytes(settings, GenerationPlan(3, 4, 28, 100, backend="transformers_continuous", page_size=64),
                             config, 10**6, 80 * 2**30)
    assert paged["kv_cache"] == 12 * 128 * per_token_layer * 3  # 128 tokens are two pages of 64
    colocate = GenerationPlan(3, 4, 28, 100, backend="vllm_colocate", gpu_memory_utilization=0.25)
    assert generation_bytes(settings, colocate, config, 10**6, 80 * 2**30) == {"vllm_engine": 20 * 2**30}
    assert generation_bytes(settings, GenerationPlan(3, 4, 28, 100, backend="vllm_server"), config, 1, 1) == {}


def test_memory_plan_check_plans_a_grpo_fit_with_its_generation_phase():
    """128 completions of 1,536 tokens generated, trained 2 at a time: the KV cache is the peak."""
    module = GRPOModule(preset="tiny-qwen3", config_overrides=OVERRIDES, tokenizer="lit-memtrain/embedded",
                        reward_funcs=[lambda completions, **kw: [0.0] * len(completions)], num_generations=2,
                        max_completion_length=1024, steps_per_generation=64, gradient_accumulation_steps=64)
    check = MemoryPlanCheck(gpu_memory_gib=1.0)
    trainer = Trainer(max_steps=0, accelerator="cpu", logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=[check])
    prompts = datasets.Dataset.from_list([{"prompt": f"{i} plus {i}"} for i in range(4)])
    trainer.fit(module, datamodule=PromptDataModule(dataset=prompts, batch_size=64, max_prompt_length=512,
                                                    drop_last=False))  # 4 prompts: a batch of 64 plans, trains none
    assert check.plan["phase"] == "generation (transformers)" and check.plan["fits"]
    kv_cache = 128 * 1536 * (2 * 2 * 16 * 4) * 3  # fp32 (32-true), 2 layers and one more
    assert any(f"kv_cache {kv_cache / 2**30:,.2f} GiB" in note for note in check.plan["notes"])
