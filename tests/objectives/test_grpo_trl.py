"""GRPOModule and RLOOModule against TRL 1.16 on the CPU in fp32, following docs/online_rl.md "Testing against TRL".

- One micro-batch's loss and gradients equal ``GRPOTrainer._compute_loss`` (every loss type, beta 0 and 0.1,
  temperature 1.0 and 0.7) and ``RLOOTrainer._compute_loss``, on the same model, prompts and completions, with
  perturbed sampling log-probabilities so that the clip binds; and the entropy each logs.
- One generation batch (completions fixed, rewards with ``None``, weights, a truncated completion) gives TRL's
  advantages, masks and reference log-probabilities (``_generate_and_score_completions``).
- The prompts' token ids equal TRL's (``_tokenize_prompts``).
"""

from __future__ import annotations

import math

import datasets
import pytest
import torch
from equivalence import TINY_MODEL_TERMS, assert_each_equal_up_to_rounding, assert_equal_up_to_rounding
from lightning.pytorch import Trainer

from lit_memtrain.datamodules.prompts import PromptDataModule
from lit_memtrain.models.generation import GenerationBackend, SamplingSettings
from lit_memtrain.models.presets import build_config
from lit_memtrain.objectives.grpo import GRPOModule
from lit_memtrain.objectives.rloo import RLOOModule
from lit_memtrain.objectives.rollout import Rollout

OVERRIDES = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 16}
QUESTIONS = ["What is 12 + 30?", "Reverse the word cat.", "What is 7 + 8 + 9?"]
G = 2
EOS = 2
# Two completions per prompt: ended by EOS at different lengths, and one truncated (no EOS in 6 tokens).
COMPLETIONS = [[40, 41, EOS], [50, 51, 52, 53, EOS], [60, EOS], [70, 71, 72, 73, 74, 75], [80, 81, 82, EOS], [90, EOS]]
MAX_COMPLETION_LENGTH = 6


def _prompts() -> datasets.Dataset:
    return datasets.Dataset.from_list(
        [{"prompt": [{"role": "user", "content": q}], "answer": str(i)} for i, q in enumerate(QUESTIONS)]
    )


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory, tokenizer):
    from transformers import AutoModelForCausalLM

    directory = tmp_path_factory.mktemp("grpo-model")
    torch.manual_seed(0)
    config = build_config("tiny-qwen3", {**OVERRIDES, "vocab_size": len(tokenizer)})
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


def _attach_trainer(module: GRPOModule) -> GRPOModule:
    """A one-process Trainer the module reads its world size and reductions from, outside a fit."""
    trainer = Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer.strategy.connect(module)
    module.trainer = trainer
    return module


def _module(saved_model: str, cls=GRPOModule, **kwargs) -> GRPOModule:
    module = cls(model=saved_model, tokenizer="lit-memtrain/embedded", reward_funcs=[_zero_reward], **kwargs)
    module.configure_model()
    return _attach_trainer(module)


def _zero_reward(completions, **kwargs):
    return [0.0] * len(completions)


def _prompt_ids(tokenizer) -> list[list[int]]:
    datamodule = PromptDataModule(dataset=_prompts(), batch_size=len(QUESTIONS), max_prompt_length=None)
    datamodule.setup("fit")
    return [ids for ids in datamodule.datasets["train"]["prompt_ids"] for _ in range(G)]


def _trl_inputs(prompt_ids: list[list[int]], pad: int) -> dict[str, torch.Tensor]:
    """TRL's layout: prompts left-padded, completions right-padded."""
    width = max(map(len, prompt_ids))
    prompt = torch.tensor([[pad] * (width - len(p)) + p for p in prompt_ids])
    prompt_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids])
    length = max(map(len, COMPLETIONS))
    completion = torch.tensor([c + [pad] * (length - len(c)) for c in COMPLETIONS])
    completion_mask = torch.tensor([[1] * len(c) + [0] * (length - len(c)) for c in COMPLETIONS])
    return {"prompt_ids": prompt, "prompt_mask": prompt_mask, "completion_ids": completion,
            "completion_mask": completion_mask}


def _trl_logps(trl, model, inputs) -> torch.Tensor:
    input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    with torch.no_grad():
        logps, _, _ = trl._get_per_token_logps_and_entropies(model, input_ids, mask, inputs["completion_ids"].shape[1])
    return logps * inputs["completion_mask"]


def _grads(module: GRPOModule) -> dict[str, torch.Tensor]:
    return {n.removeprefix("model."): p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def _assert_same_grads(ours: dict[str, torch.Tensor], model: torch.nn.Module) -> None:
    theirs = {n: p.grad for n, p in model.named_parameters()}
    assert_each_equal_up_to_rounding(ours, theirs, terms=TINY_MODEL_TERMS)


@pytest.mark.parametrize(
    ("loss_type", "beta", "temperature"),
    [("dapo", 0.0, 1.0), ("dapo", 0.1, 1.0), ("dapo", 0.0, 0.7), ("dapo", 0.1, 0.7),
     ("grpo", 0.0, 1.0), ("grpo", 0.1, 1.0), ("grpo", 0.0, 0.7), ("grpo", 0.1, 0.7),
     ("dr_grpo", 0.1, 0.7), ("bnpo", 0.1, 1.0)],
)
def test_one_micro_batch_equals_trl_grpo_compute_loss(saved_model, tokenizer, tmp_path, loss_type, beta, temperature):
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    config = GRPOConfig(
        output_dir=str(tmp_path), use_cpu=True, bf16=False, disable_dropout=True, report_to=[], loss_type=loss_type,
        beta=beta, temperature=temperature, per_device_train_batch_size=len(COMPLETIONS), num_generations=G,
        max_completion_length=MAX_COMPLETION_LENGTH, epsilon=0.2, epsilon_high=0.28,
    )
    trl_model = AutoModelForCausalLM.from_pretrained(saved_model, attn_implementation="sdpa")
    trl = GRPOTrainer(model=trl_model, reward_funcs=_zero_reward, args=config, train_dataset=_prompts(),
                      processing_class=tokenizer)
    trl_model.train()
    trl.current_gradient_accumulation_steps = 1
    prompt_ids = _prompt_ids(tokenizer)
    trl_prompt_ids, _, _ = trl._tokenize_prompts([[{"role": "user", "content": q}] for q in QUESTIONS])
    assert prompt_ids[::G] == [list(ids) for ids in trl_prompt_ids]  # the datamodule tokenizes as TRL does

    inputs = _trl_inputs(prompt_ids, tokenizer.pad_token_id)
    mask = inputs["completion_mask"].float()
    logps = _trl_logps(trl, trl_model, inputs)
    generator = torch.Generator().manual_seed(1)
    old = (logps + 0.3 * torch.randn(logps.shape, generator=generator)) * mask  # so that the clip binds
    ref = (logps + 0.2 * torch.randn(logps.shape, generator=generator)) * mask
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5, -1.2, 1.2])
    inputs.update(advantages=advantages, num_items_in_batch=mask.sum(), old_per_token_logps=old)
    if beta:
        inputs["ref_per_token_logps"] = ref
    trl_loss = trl._compute_loss(trl_model, inputs)
    trl_loss.backward()

    module = _module(saved_model, policy_loss=loss_type, beta=beta, temperature=temperature, num_generations=G,
                     max_completion_length=MAX_COMPLETION_LENGTH, epsilon=0.2, epsilon_high=0.28)
    rollout = Rollout.of(prompt_ids, COMPLETIONS, torch.ones(len(COMPLETIONS), dtype=torch.bool))
    with torch.no_grad():  # the chunked, padding-free log-probabilities are TRL's
        assert_equal_up_to_rounding(module.completion_logps(rollout), logps, name="log-probs", terms=TINY_MODEL_TERMS)
    rollout = Rollout(rollout.prompt_ids, rollout.completion_ids, rollout.trained, rollout.width, advantages, old,
                      ref if beta else None)
    out = module.slice_loss(rollout, module.loss_normalizer(rollout))
    out.loss.backward()
    summed = float(advantages.abs().max())  # the loss sums advantage x ratio (about 1) of either sign
    assert_equal_up_to_rounding(out.loss, trl_loss, name="loss", terms=TINY_MODEL_TERMS, scale=summed)
    _assert_same_grads(_grads(module), trl_model)
    assert out.low_clipped.any() or out.high_clipped.any()  # the perturbation made the clip bind
    _assert_trls_entropy(module, out, rollout, trl)


def _assert_trls_entropy(module: GRPOModule, out, rollout: Rollout, trl) -> None:
    """The entropy of the trained tokens (from the training forward's chunks of logits) is TRL's."""
    entropy = float(out.entropy.sum() / rollout.completion_mask().sum())
    assert_equal_up_to_rounding(entropy, trl._metrics["train"]["entropy"][-1], name="entropy", terms=TINY_MODEL_TERMS)
    assert 0 < entropy < math.log(module.model.config.vocab_size)


def test_one_micro_batch_equals_trl_rloo_compute_loss(saved_model, tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM
    from trl import RLOOConfig, RLOOTrainer

    config = RLOOConfig(
        output_dir=str(tmp_path), use_cpu=True, bf16=False, disable_dropout=True, report_to=[], beta=0.0,
        temperature=0.7, per_device_train_batch_size=len(COMPLETIONS), num_generations=G,
        max_completion_length=MAX_COMPLETION_LENGTH,
    )
    trl_model = AutoModelForCausalLM.from_pretrained(saved_model, attn_implementation="sdpa")
    trl = RLOOTrainer(model=trl_model, reward_funcs=_zero_reward, args=config, train_dataset=_prompts(),
                      processing_class=tokenizer)
    trl_model.train()
    prompt_ids = _prompt_ids(tokenizer)
    inputs = _trl_inputs(prompt_ids, tokenizer.pad_token_id)
    mask = inputs["completion_mask"].float()
    logps = _trl_logps(trl, trl_model, inputs)
    old = (logps + 0.2 * torch.randn(logps.shape, generator=torch.Generator().manual_seed(2))) * mask
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5, -1.2, 1.2])
    inputs.update(advantages=advantages, old_logps=(old * mask).sum(1))
    trl_loss = trl._compute_loss(trl_model, inputs)
    trl_loss.backward()

    module = _module(saved_model, cls=RLOOModule, beta=0.0, temperature=0.7, num_generations=G,
                     max_completion_length=MAX_COMPLETION_LENGTH)
    rollout = Rollout(prompt_ids, COMPLETIONS, torch.ones(len(COMPLETIONS), dtype=torch.bool),
                      max(map(len, COMPLETIONS)), advantages, old)
    out = module.slice_loss(rollout, module.loss_normalizer(rollout))
    out.loss.backward()
    summed = float(advantages.abs().max())  # the loss sums advantage x ratio (about 1) of either sign
    assert_equal_up_to_rounding(out.loss, trl_loss, name="loss", terms=TINY_MODEL_TERMS, scale=summed)
    _assert_same_grads(_grads(module), trl_model)
    assert out.low_clipped.any() or out.high_clipped.any()
    _assert_trls_entropy(module, out, rollout, trl)


class FixedCompletions(GenerationBackend):
    """A generation backend that returns the test's completions: TRL's generation is patched to the same ones."""

    def generate(self, model, prompt_ids, num_generations, device, weights_version):
        assert len(prompt_ids) * num_generations == len(COMPLETIONS)
        return [list(c) for c in COMPLETIONS]


def _length_reward(completions, answer, **kwargs):
    """Rewards that differ within groups, with one completion left unscored."""
    texts = [c[-1]["content"] for c in completions]
    return [None if i == 4 else float(len(text) % 5) + float(a) for i, (text, a) in enumerate(zip(texts, answer))]


def _tokens_reward(completions, completion_ids, **kwargs):
    return [float(ids[0] % 7) for ids in completion_ids]


@pytest.mark.parametrize(
    ("cls", "options"),
    [(GRPOModule, {"scale_rewards": "group", "beta": 0.1}), (GRPOModule, {"scale_rewards": "batch"}),
     (GRPOModule, {"scale_rewards": "none", "mask_truncated_completions": True}),
     (GRPOModule, {"multi_objective_aggregation": "normalize_then_sum"}),
     (RLOOModule, {"beta": 0.05}), (RLOOModule, {"beta": 0.0, "normalize_advantages": True}),
     (RLOOModule, {"beta": 0.05, "reward_clip_range": (1.0, 3.0)})],
    ids=["grpo-group-beta", "grpo-batch", "grpo-none-masked", "grpo-normalize-then-sum", "rloo-beta",
         "rloo-normalized", "rloo-clipped"],
)
def test_one_generation_batch_equals_trl_generate_and_score(saved_model, tokenizer, tmp_path, cls, options):
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

    grpo = cls is GRPOModule
    Config, TrainerClass = (GRPOConfig, GRPOTrainer) if grpo else (RLOOConfig, RLOOTrainer)
    config = Config(
        output_dir=str(tmp_path), use_cpu=True, bf16=False, disable_dropout=True, report_to=[],
        per_device_train_batch_size=len(COMPLETIONS), num_generations=G, max_completion_length=MAX_COMPLETION_LENGTH,
        reward_weights=[1.0, 0.5], temperature=0.7, **options,
    )
    trl_model = AutoModelForCausalLM.from_pretrained(saved_model, attn_implementation="sdpa")
    trl = TrainerClass(model=trl_model, reward_funcs=[_length_reward, _tokens_reward], args=config,
                       train_dataset=_prompts(), processing_class=tokenizer)
    if grpo:
        trl._generate_single_turn = lambda *args, **kwargs: ([list(c) for c in COMPLETIONS], None)
    else:
        trl._generate_single_turn = lambda *args, **kwargs: [list(c) for c in COMPLETIONS]
    trl_model.train()
    rows = [row for row in _prompts() for _ in range(G)]
    expected = trl._generate_and_score_completions(rows)

    backend = FixedCompletions(SamplingSettings(MAX_COMPLETION_LENGTH, temperature=0.7), [EOS], 0)
    module = cls(model=saved_model, tokenizer="lit-memtrain/embedded", reward_funcs=[_length_reward, _tokens_reward],
                 reward_weights=[1.0, 0.5], num_generations=G, max_completion_length=MAX_COMPLETION_LENGTH,
                 temperature=0.7, generation_backend=backend, **options)
    module.configure_model()
    _attach_trainer(module)
    datamodule = PromptDataModule(dataset=_prompts(), batch_size=len(QUESTIONS), max_prompt_length=None)
    datamodule.setup("fit")
    batch = datamodule.collator()([datamodule.datasets["train"][i] for i in range(len(QUESTIONS))])
    rollout, rewards, _ = module.generate_rollout(batch, "a test batch")
    rollout, metrics = module.prepare_rollout(rollout, rewards)

    assert_equal_up_to_rounding(rollout.advantages, expected["advantages"], name="advantages", terms=len(COMPLETIONS))
    assert rollout.advantages.abs().sum() > 0
    torch.testing.assert_close(rollout.completion_mask(), expected["completion_mask"].float())
    if "ref_per_token_logps" in expected:
        theirs = expected["ref_per_token_logps"] * expected["completion_mask"]
        assert_equal_up_to_rounding(rollout.ref_logps, theirs, name="reference log-probs", terms=TINY_MODEL_TERMS)
    if not grpo and options["beta"]:  # RLOO's KL penalty needs the sampling policy's: TRL's, summed per completion
        assert rollout.old_logps is not None, "RLOO with beta != 0 made no log-probabilities at generation time"
        mask = rollout.completion_mask()
        old_logps = (rollout.old_logps * mask).sum(1)
        assert_equal_up_to_rounding(old_logps, expected["old_logps"], name="old log-probs", terms=TINY_MODEL_TERMS)
    theirs = trl._metrics["train"]["reward"][-1]
    assert_equal_up_to_rounding(metrics["reward"], theirs, name="reward", terms=len(COMPLETIONS))
    assert metrics["frac_reward_zero_std"] == pytest.approx(trl._metrics["train"]["frac_reward_zero_std"][-1])
    if not grpo and options["beta"]:
        theirs = trl._metrics["train"]["kl"][-1]  # each token's exp(d) - d - 1 cancels terms of about 1
        assert_equal_up_to_rounding(float(metrics["kl"]), theirs, name="kl", terms=TINY_MODEL_TERMS, scale=1.0)
