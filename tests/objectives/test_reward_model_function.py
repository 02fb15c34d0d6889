"""RewardModelFunction: an exported reward model scores completions as online RL's reward function, each the
reward the trained module gives the same prompt + completion, through GRPO's reward-function checks."""

from __future__ import annotations

import datasets
import pytest
import torch
from equivalence import TINY_MODEL_TERMS, assert_equal_up_to_rounding
from transformers import AutoModelForSequenceClassification

from lit_memtrain.datamodules.preference import PreferenceDataModule
from lit_memtrain.models.presets import build_config
from lit_memtrain.objectives.reward import RewardModule
from lit_memtrain.objectives.reward_functions import RewardFunctions
from lit_memtrain.objectives.reward_model_function import RewardModelFunction

OVERRIDES = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "head_dim": 16}
QUESTIONS = [("What is 12 + 30?", "42", "41"), ("Reverse the word cat.", "tac", "cta"), ("What is 7 + 8?", "15", "5")]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    torch.manual_seed(0)
    module = RewardModule(preset="tiny-qwen3", tokenizer="lit-memtrain/embedded", config_overrides=OVERRIDES)
    module.configure_model()
    module.model.eval()
    return module, module.export(tmp_path_factory.mktemp("reward") / "export")


def _module_rewards(module: RewardModule, rows: list[dict]) -> torch.Tensor:
    """The rewards the module gives each row's prompt + chosen (its training path: the datamodule's batch)."""
    datamodule = PreferenceDataModule(dataset=datasets.Dataset.from_list(rows), batch_size=len(rows), long_pairs="drop")
    datamodule.setup("fit")
    train = datamodule.datasets["train"]
    with torch.no_grad():
        return module.sequence_rewards(datamodule.collator()([train[i] for i in range(len(train))])).chunk(2)[0]


@pytest.mark.parametrize("conversational", [True, False], ids=["messages", "strings"])
def test_an_exported_reward_model_scores_completions_as_the_trained_module(exported, conversational):
    module, path = exported
    if conversational:
        prompts = [[{"role": "user", "content": q}] for q, _, _ in QUESTIONS]
        completions = [[{"role": "assistant", "content": a}] for _, a, _ in QUESTIONS]
        wrong = [[{"role": "assistant", "content": b}] for _, _, b in QUESTIONS]
    else:
        prompts = [f"Q: {q} A:" for q, _, _ in QUESTIONS]
        completions, wrong = [f" {a}" for _, a, _ in QUESTIONS], [f" {b}" for _, _, b in QUESTIONS]
    score = RewardModelFunction(str(path), batch_size=2, name="rm")
    rewards = score(prompts=prompts, completions=completions, answer=["42", "tac", "15"], trainer_state=None)
    rows = [{"prompt": p, "chosen": c, "rejected": w} for p, c, w in zip(prompts, completions, wrong)]
    assert_equal_up_to_rounding(rewards, _module_rewards(module, rows), name="rewards", terms=TINY_MODEL_TERMS)

    functions = RewardFunctions([score])  # what GRPOModule calls, with its checks
    checked = functions(prompts, completions, [[1]] * len(prompts), {"answer": ["42", "tac", "15"]}, where="a batch")
    assert functions.names == ["rm"]
    assert_equal_up_to_rounding(checked[:, 0].tolist(), rewards, name="checked rewards", terms=1)


def test_a_model_that_is_not_a_reward_model_or_a_foreign_tokenizer_is_refused(exported, tokenizer):
    _, path = exported
    config = build_config("tiny-qwen3", {**OVERRIDES, "num_labels": 2, "pad_token_id": tokenizer.pad_token_id})
    with pytest.raises(ValueError, match=r"num_labels=2; a reward model has one output"):
        RewardModelFunction(AutoModelForSequenceClassification.from_config(config), tokenizer)
    with pytest.raises(ValueError, match=r"Give the tokenizer the reward model was trained with"):
        RewardModelFunction(AutoModelForSequenceClassification.from_pretrained(path))
    other = RewardModelFunction(str(path)).tokenizer
    other.pad_token = other.eos_token
    with pytest.raises(ValueError, match=r"reads its reward past pad token id 0, but the tokenizer pads with id 2"):
        RewardModelFunction(str(path), other)
