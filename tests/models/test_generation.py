"""The generation backend interface and Hugging Face ``generate`` behind it: completions cut after their first EOS,
the sampling settings winning over a checkpoint's generation config, the KV cache used even where training turned
it off, and the model handed back in training mode."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from lit_memtrain.models.generation import BACKENDS, SamplingSettings, TransformersGenerate, cut_after_eos
from lit_memtrain.models.presets import build_config

CPU = torch.device("cpu")


@pytest.fixture
def model():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(build_config("tiny-qwen3", {"vocab_size": 384})).train()


def test_cut_after_eos_keeps_the_first_eos_and_the_length_limit():
    assert cut_after_eos([5, 6, 2, 7, 2], [2], 8) == [5, 6, 2]
    assert cut_after_eos([5, 6, 7, 8], [2, 3], 3) == [5, 6, 7]
    assert cut_after_eos([3, 2], [2, 3], 8) == [3]
    assert BACKENDS["transformers"] is TransformersGenerate


def test_sampling_settings_refuse_values_out_of_range():
    for bad, match in [({"temperature": 0}, "do_sample=False"), ({"top_p": 0}, "top_p"), ({"top_k": -1}, "top_k"),
                       ({"min_p": 2}, "min_p"), ({"repetition_penalty": 0}, "repetition_penalty"),
                       ({"max_completion_length": 0}, "max_completion_length")]:
        with pytest.raises(ValueError, match=match):
            SamplingSettings(**bad)


def test_greedy_completions_match_generating_each_prompt_alone_and_stop_at_eos(model):
    prompts = [[5, 6, 7, 8, 9], [10, 11]]
    greedy = TransformersGenerate(SamplingSettings(max_completion_length=6, do_sample=False), [2], 0)
    together = greedy.generate(model, prompts, 2, CPU, 0)
    assert len(together) == 4 and together[0] == together[1] and together[2] == together[3]
    alone = [greedy.generate(model, [p], 1, CPU, 0)[0] for p in prompts]
    assert [together[0], together[2]] == alone  # left padding changes nothing
    eos = together[0][2]  # make the third generated token an end of sequence: the completion stops there
    stopping = TransformersGenerate(SamplingSettings(max_completion_length=6, do_sample=False), [eos], 0)
    assert stopping.generate(model, prompts[:1], 1, CPU, 0)[0] == together[0][: together[0].index(eos) + 1]
    assert model.training


def test_the_sampling_settings_override_the_models_generation_config(model):
    model.generation_config.top_k = 1  # a checkpoint's own setting: greedy in effect
    sampled = TransformersGenerate(SamplingSettings(max_completion_length=8), [2], 0)
    torch.manual_seed(1)
    completions = sampled.generate(model, [[5, 6, 7]], 6, CPU, 0)
    assert len({tuple(c) for c in completions}) > 1
    torch.manual_seed(1)
    assert sampled.generate(model, [[5, 6, 7]], 6, CPU, 0) == completions  # seeded: reproducible


def test_generation_uses_the_kv_cache_even_when_the_config_turned_it_off(model):
    model.config.use_cache = False  # what GradientCheckpointing does during fit
    seen = []
    model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append((kwargs["input_ids"].shape[1], module.training)), with_kwargs=True
    )
    backend = TransformersGenerate(SamplingSettings(max_completion_length=4, do_sample=False), [2], 0)
    backend.generate(model, [[5, 6, 7]], 1, CPU, 0)
    assert seen == [(3, False), (1, False), (1, False), (1, False)]  # the prompt once, then one new token a step
    assert model.training and not model.config.use_cache
