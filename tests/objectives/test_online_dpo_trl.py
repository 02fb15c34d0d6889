"""OnlineDPOModule against TRL 1.16's ``OnlineDPOTrainer.training_step`` on the CPU in fp32.

Same model, prompts and fixed completions (TRL's ``_generate`` and our generation backend both patched to return
them, in each one's layout), ``missing_eos_penalty`` on: one step's loss, gradients and logged metrics are TRL's,
for ``sigmoid`` and ``ipo``, judged by weighted reward functions (one returning ``None``, a prompt cut by
``max_length``) and by a trained reward model (:class:`RewardModelFunction` against TRL's sequence-classification
model).
"""

from __future__ import annotations

import datasets
import pytest
import torch
from equivalence import TINY_MODEL_TERMS, assert_each_equal_up_to_rounding, assert_equal_up_to_rounding
from lightning.pytorch import Trainer
from tiny_models import TINY_OVERRIDES, save_tiny_causal_lm

from lit_memtrain.datamodules.prompts import PromptDataModule
from lit_memtrain.models.generation import GenerationBackend, SamplingSettings
from lit_memtrain.models.presets import build_config
from lit_memtrain.objectives.online_dpo import OnlineDPOModule
from lit_memtrain.objectives.reward_model_function import RewardModelFunction

QUESTIONS = ["What is 12 + 30?", "Reverse the word cat.", "What is 7 + 8 + 9?"]
EOS, MAX_NEW_TOKENS = 2, 6
# Two completions per prompt, adjacent (our layout): ended at different lengths, and two truncated (no EOS in 6).
VARIED = [[40, 41, EOS], [50, 51, 52, 53, 54, 55], [60, EOS], [70, 71, 72, 73, EOS], [80, 81, 82, 83, 84, 85],
          [90, EOS]]
# All of MAX_NEW_TOKENS tokens (no padding in TRL's batch, whose objective/kl and entropy then sum no pad position).
EQUAL = [[40, 41, 42, 43, 44, EOS], [50, 51, 52, 53, 54, 55], [60, 61, 62, 63, 64, EOS], [70, 71, 72, 73, 74, 75],
         [80, 81, 82, 83, 84, 85], [90, 91, 92, 93, 94, EOS]]
ALL_METRICS = ("objective/kl", "objective/entropy", "objective/non_score_reward", "objective/rlhf_reward",
               "objective/scores", "objective/scores_margin", "rewards/chosen", "rewards/rejected",
               "rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected", "val/contain_eos_token")
PADDING_SUMMED = ("objective/kl", "objective/entropy", "objective/non_score_reward", "objective/rlhf_reward")


def _prompts() -> datasets.Dataset:
    return datasets.Dataset.from_list(
        [{"prompt": [{"role": "user", "content": q}], "answer": str(i)} for i, q in enumerate(QUESTIONS)]
    )


@pytest.fixture(scope="module")
def saved_models(tmp_path_factory, tokenizer):
    """A policy and a reward model (one-output sequence classification of the same tiny architecture)."""
    from transformers import AutoModelForSequenceClassification

    directory = tmp_path_factory.mktemp("online-dpo-models")
    save_tiny_causal_lm(directory / "policy", tokenizer)
    config = build_config("tiny-qwen3", {**TINY_OVERRIDES, "vocab_size": len(tokenizer)})
    config.num_labels, config.pad_token_id = 1, tokenizer.pad_token_id
    torch.manual_seed(1)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(directory / "reward")
    return str(directory / "policy"), str(directory / "reward")


class FixedCompletions(GenerationBackend):
    def __init__(self, completions, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.completions = completions

    def generate(self, model, prompt_ids, num_generations, device, weights_version):
        assert len(prompt_ids) * num_generations == len(self.completions)
        return [list(c) for c in self.completions]


def _length_reward(completions, completion_ids, answer, **kwargs):
    """Rewards that differ within pairs; one completion left unscored (None: 0 in TRL's weighted sum)."""
    texts = [c[-1]["content"] for c in completions]
    return [None if ids[0] == 80 else float(len(text) % 5) + float(a)
            for text, ids, a in zip(texts, completion_ids, answer)]


def _tokens_reward(completions, completion_ids, **kwargs):
    return [float(ids[0] % 7) / 3 for ids in completion_ids]


def _batch(tokenizer):
    datamodule = PromptDataModule(dataset=_prompts(), batch_size=len(QUESTIONS), max_prompt_length=None)
    datamodule.setup("fit")
    return datamodule.collator()([datamodule.datasets["train"][i] for i in range(len(QUESTIONS))])


def _trl_generation(prompt_ids: list[list[int]], completions: list[list[int]], pad: int):
    """TRL's ``_generate`` output: prompts left-padded and repeated (all first completions, then all second ones),
    completions right-padded."""
    order = [2 * i for i in range(len(prompt_ids))] + [2 * i + 1 for i in range(len(prompt_ids))]
    width = max(map(len, prompt_ids))
    prompts = [[pad] * (width - len(p)) + p for p in prompt_ids] * 2
    prompt_mask = [[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids] * 2
    length = max(map(len, completions))
    ordered = [completions[i] for i in order]
    completion = [c + [pad] * (length - len(c)) for c in ordered]
    completion_mask = [[1] * len(c) + [0] * (length - len(c)) for c in ordered]
    return (torch.tensor(prompts), torch.tensor(prompt_mask), torch.tensor(completion),
            torch.tensor(completion_mask), None)


def _trained(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` moved away from its initial weights (the reference) as training would, the same way each call: so
    that the implicit rewards and the loss are not those of a policy equal to its reference."""
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for _, parameter in sorted(model.named_parameters()):
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    return model


@pytest.mark.parametrize(
    ("loss_type", "judge", "completions", "max_length"),
    [("sigmoid", "functions", VARIED, 14), ("ipo", "functions", VARIED, 14),
     ("sigmoid", "reward_model", EQUAL, 512), ("ipo", "reward_model", EQUAL, 512)],
    ids=["sigmoid-functions", "ipo-functions", "sigmoid-reward-model", "ipo-reward-model"],
)
def test_one_step_equals_trl_online_dpo(saved_models, tokenizer, tmp_path, loss_type, judge, completions, max_length):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
    from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer

    policy, reward = saved_models
    beta, weights = 0.3, ([1.0, 0.5] if judge == "functions" else None)
    config = OnlineDPOConfig(
        output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[], gradient_checkpointing=False,
        per_device_train_batch_size=len(QUESTIONS), max_new_tokens=MAX_NEW_TOKENS, max_length=max_length, beta=beta,
        loss_type=loss_type, missing_eos_penalty=1.5, temperature=0.7, reward_weights=weights,
    )
    trl_model = _trained(AutoModelForCausalLM.from_pretrained(policy, attn_implementation="sdpa"))
    reference = AutoModelForCausalLM.from_pretrained(policy, attn_implementation="sdpa")  # the initial weights
    if judge == "functions":
        functions = [_length_reward, _tokens_reward]
        trl = OnlineDPOTrainer(model=trl_model, ref_model=reference, reward_funcs=functions, args=config,
                               train_dataset=_prompts(), processing_class=tokenizer)
        options = {"reward_funcs": functions, "reward_weights": weights}
    else:
        trl_reward = AutoModelForSequenceClassification.from_pretrained(reward)
        trl = OnlineDPOTrainer(model=trl_model, ref_model=reference, reward_funcs=trl_reward, args=config,
                               train_dataset=_prompts(), processing_class=tokenizer,
                               reward_processing_classes=tokenizer)
        options = {"reward_funcs": [RewardModelFunction(reward, tokenizer=tokenizer, device="cpu")]}
    batch = _batch(tokenizer)
    trl._generate = lambda *args, **kwargs: _trl_generation(batch["prompt_ids"], completions, tokenizer.pad_token_id)
    rows = list(_prompts())
    inputs = {"prompt": [row["prompt"] for row in rows], "answer": [row["answer"] for row in rows]}
    trl_loss = trl.training_step(trl_model, inputs)

    backend = FixedCompletions(completions, SamplingSettings(MAX_NEW_TOKENS, temperature=0.7), [EOS], 0)
    module = OnlineDPOModule(
        model=policy, tokenizer="lit-memtrain/embedded", preference_loss=loss_type, beta=beta, missing_eos_penalty=1.5,
        max_new_tokens=MAX_NEW_TOKENS, max_length=max_length, temperature=0.7, generation_backend=backend, **options,
    )  # fmt: skip
    module.configure_model()  # the frozen reference: a copy of the initial weights
    _trained(module.model)
    trainer = Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer.strategy.connect(module)
    module.trainer = trainer
    rollout, scores, truncated, _ = module._generate_and_score(batch, "a test batch")
    loss, metrics = module.pair_step(rollout, module.pair_scores(scores, truncated, "a test batch"), truncated)
    loss.backward()

    assert_equal_up_to_rounding(loss, trl_loss, name="loss", terms=TINY_MODEL_TERMS, scale=max(1.0, float(loss)))
    ours = {n.removeprefix("model."): p.grad for n, p in module.named_parameters() if p.grad is not None}
    theirs = {n: p.grad for n, p in trl_model.named_parameters()}
    assert_each_equal_up_to_rounding(ours, theirs, terms=TINY_MODEL_TERMS)
    compared = ALL_METRICS if completions is EQUAL else tuple(m for m in ALL_METRICS if m not in PADDING_SUMMED)
    for name in compared:
        expected = trl.stats[name][-1]
        assert_equal_up_to_rounding(float(metrics[name]), expected, name=name, terms=TINY_MODEL_TERMS,
                                    scale=max(1.0, abs(expected)))
    assert 0 < float(metrics["val/contain_eos_token"]) < 1  # the penalty applied to some completions, not all
    assert float(metrics["rewards/margins"]) != 0  # the policy is not its reference
