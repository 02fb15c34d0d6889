"""Whole optimizer steps of GRPOModule and RLOOModule, through a Lightning Trainer, against TRL 1.16's
``GRPOTrainer.train()`` / ``RLOOTrainer.train()`` on the same tiny model, prompts and (fixed) completions.

Why beside the one-micro-batch comparisons (test_grpo_trl.py): those check the loss of one slice and the advantages
of one generation batch; what a step does between them is checked here against TRL itself: the sampling policy's
log-probabilities kept from generation time over ``num_iterations`` passes (off-policy: a stale or a refreshed copy
gives other weights), the slices each optimizer step trains on, the token normaliser of an accumulation window, the
reference's KL term and RLOO's KL-penalised rewards. SGD with a constant learning rate and no clipping, so that the
final weights are a direct function of the gradients of each window.
"""

from __future__ import annotations

import datasets
import pytest
import torch
from equivalence import TINY_MODEL_TERMS, assert_each_equal_up_to_rounding
from lightning.pytorch import Trainer
from tiny_models import save_tiny_causal_lm

from lit_memtrain.datamodules.prompts import PromptDataModule
from lit_memtrain.models.generation import GenerationBackend, SamplingSettings
from lit_memtrain.objectives.grpo import GRPOModule
from lit_memtrain.objectives.rloo import RLOOModule

QUESTIONS = ["What is 12 + 30?", "Reverse the word cat.", "What is 7 + 8 + 9?"]
EOS, G, MAX_COMPLETION_LENGTH = 2, 2, 6
# Per prompt, its two completions: of different lengths, the second of the last two truncated (no EOS in 6 tokens).
COMPLETIONS = [[[40, 41, EOS], [50, 51, 52, 53, EOS]], [[60, EOS], [70, 71, 72, 73, 74, 75]],
               [[80, 81, 82, EOS], [90, 91, 92, 93, 94, 95]]]


def _prompts() -> datasets.Dataset:
    return datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": q}]} for q in QUESTIONS])


def _reward(completion_ids, **kwargs):
    """Differs within each group, so every group has advantages to train on."""
    return [float(ids[0] % 7) + 0.3 * len(ids) for ids in completion_ids]


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory, tokenizer):
    directory = tmp_path_factory.mktemp("grpo-train-model")
    save_tiny_causal_lm(directory, tokenizer)
    tokenizer.save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="module")
def prompt_index():
    """Each prompt's token ids (as the datamodule and TRL tokenize it) -> its place in COMPLETIONS."""
    datamodule = PromptDataModule(dataset=_prompts(), batch_size=len(QUESTIONS), max_prompt_length=None)
    datamodule.setup("fit")
    return {tuple(ids): i for i, ids in enumerate(datamodule.datasets["train"]["prompt_ids"])}


class PromptCompletions(GenerationBackend):
    def __init__(self, prompt_index, *args) -> None:
        super().__init__(*args)
        self.prompt_index = prompt_index

    def generate(self, model, prompt_ids, num_generations, device, weights_version):
        return [list(COMPLETIONS[self.prompt_index[tuple(p)]][g]) for p in prompt_ids for g in range(num_generations)]


def _trl_weights(saved_model, tokenizer, tmp_path, prompt_index, grpo: bool, steps: int, options: dict) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

    Config, TrainerClass = (GRPOConfig, GRPOTrainer) if grpo else (RLOOConfig, RLOOTrainer)
    config = Config(
        output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[], disable_dropout=True,
        per_device_train_batch_size=len(QUESTIONS), num_generations=G, max_completion_length=MAX_COMPLETION_LENGTH,
        shuffle_dataset=False, max_steps=steps, optim="sgd", lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, max_grad_norm=0.0, save_strategy="no", seed=0, **options,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(saved_model, attn_implementation="sdpa")
    trainer = TrainerClass(model=model, reward_funcs=_reward, args=config, train_dataset=_prompts(),
                           processing_class=tokenizer)
    drawn: dict[int, int] = {}

    def generate(prompt_ids, *args, **kwargs):  # one row per completion: a prompt's rows get its completions in turn
        completions = []
        for ids in prompt_ids:
            index = prompt_index[tuple(ids)]
            drawn[index] = drawn.get(index, 0) + 1
            completions.append(list(COMPLETIONS[index][(drawn[index] - 1) % G]))
        return (completions, None) if grpo else completions

    trainer._generate_single_turn = generate
    trainer.train()
    assert trainer.state.global_step == steps
    return {name: param.detach().clone() for name, param in model.named_parameters()}


def _our_weights(saved_model, prompt_index, cls, steps: int, options: dict) -> dict[str, torch.Tensor]:
    options = dict(options)
    learning_rate = options.pop("learning_rate")
    backend = PromptCompletions(prompt_index, SamplingSettings(MAX_COMPLETION_LENGTH, options["temperature"]), [EOS], 0)
    module = cls(
        model=saved_model, tokenizer="lit-memtrain/embedded", attn_implementation="sdpa", reward_funcs=[_reward],
        num_generations=G, max_completion_length=MAX_COMPLETION_LENGTH, generation_backend=backend, disable_dropout=True,
        max_grad_norm=None, warmup=0, min_lr_ratio=1.0, optimizer={"class_path": "torch.optim.SGD",
        "init_args": {"lr": learning_rate}}, **options,
    )  # fmt: skip
    trainer = Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False)
    data = PromptDataModule(dataset=_prompts(), batch_size=len(QUESTIONS), max_prompt_length=None, seed=0)
    trainer.fit(module, datamodule=data)
    assert trainer.global_step == steps
    return {name.removeprefix("model."): param.detach() for name, param in module.named_parameters()}


COMMON = {"gradient_accumulation_steps": 2, "num_iterations": 2, "temperature": 0.7, "learning_rate": 0.1}
RUNS = {
    # One generation batch, two passes over it in two slices, an optimizer step per pass: the second step trains
    # off-policy against the log-probabilities kept from generation time, and its KL term (the policy has moved)
    # against the frozen reference.
    "grpo-dapo-kl": (GRPOModule, 2, {"policy_loss": "dapo", "beta": 0.1, "epsilon_high": 0.28}),
    "grpo-grpo-masked": (GRPOModule, 2, {"policy_loss": "grpo", "mask_truncated_completions": True}),
    "grpo-dr_grpo-batch-scaled": (GRPOModule, 2, {"policy_loss": "dr_grpo", "beta": 0.05, "scale_rewards": "batch"}),
    # RLOO over two generation batches: the second one's KL penalty on the rewards compares a moved policy with the
    # reference (at the first, both are the initial model). RLOO's ratio is one per completion, of its summed
    # log-probabilities: steps of 0.1 move the weights so far that four steps' roundings add up past one step's.
    "rloo-kl": (RLOOModule, 4, {"beta": 0.5, "learning_rate": 0.01}),
    # An optimizer step per slice, two slices per generation batch, max_steps=3: TRL stops after the first slice of
    # the second generation batch (a module that finished the batch took a fourth step).
    "grpo-bnpo-step-per-slice-odd-max-steps": (GRPOModule, 3, {"policy_loss": "bnpo", "beta": 0.1,
                                                               "gradient_accumulation_steps": 1, "num_iterations": 1,
                                                               "steps_per_generation": 2}),
}


@pytest.mark.parametrize("run", list(RUNS))
def test_whole_optimizer_steps_give_trls_weights(saved_model, tokenizer, tmp_path, prompt_index, monkeypatch, run):
    """Shuffles (TRL's and ours, of prompts and of a generation batch's completions) keep the order: a step per slice
    then trains on the same completions on both sides."""
    arange = torch.arange
    monkeypatch.setattr(torch, "randperm", lambda n, *args, **kwargs: arange(n))
    cls, steps, options = RUNS[run]
    options = {**COMMON, **options}
    trl_options = {("loss_type" if name == "policy_loss" else name): value for name, value in options.items()}
    theirs = _trl_weights(saved_model, tokenizer, tmp_path, prompt_index, cls is GRPOModule, steps, trl_options)
    ours = _our_weights(saved_model, prompt_index, cls, steps, options)
    assert_each_equal_up_to_rounding(ours, theirs, terms=TINY_MODEL_TERMS)
