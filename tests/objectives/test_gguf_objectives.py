"""Every objective takes a GGUF file as its model: the decoder of the file's weights, and its tokenizer."""

import pytest
import torch
from gguf_writer import tiny_llama

from lit_memtrain import DPOModule, GRPOModule, RewardModule, RLOOModule

REWARDS = {"reward_funcs": ["lit_memtrain.objectives.arithmetic_rewards.exact_answer"]}


@pytest.mark.parametrize(
    ("module_class", "kwargs"),
    [(DPOModule, {}), (RewardModule, {}), (GRPOModule, REWARDS), (RLOOModule, REWARDS)],
    ids=["dpo", "reward", "grpo", "rloo"],
)
def test_an_objective_builds_the_decoder_of_a_gguf_file_with_its_tokenizer(tiny_gguf, module_class, kwargs):
    module = module_class(model=str(tiny_gguf), **kwargs)
    module.configure_model()
    expected = tiny_llama().model.layers[1].mlp.down_proj.weight
    torch.testing.assert_close(module.model.model.layers[1].mlp.down_proj.weight, expected)
    assert module.tokenizer.eos_token == "<|im_end|>" and module.tokenizer.chat_template
