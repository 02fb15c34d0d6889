"""GRPOModule and RLOOModule through fits and their public steps: padding-free equals padded and chunked equals plain
log-probabilities, the two references (adapter disabled, frozen copy), TRL's schedule of optimizer steps over
iterations and slices, the memory callbacks composing, validation, and clear errors before any work."""

from __future__ import annotations

import datasets
import pytest
import torch
from equivalence import TINY_MODEL_TERMS, assert_each_equal_up_to_rounding, assert_equal_up_to_rounding
from lightning.pytorch import Callback, Trainer
from memory_effects import TechniquesInEffect

from lit_memtrain.callbacks import ActivationOffloading, GradientCheckpointing, TiledMLP
from lit_memtrain.datamodules.prompts import PromptDataModule
from lit_memtrain.models.generation import SamplingSettings, TransformersGenerate
from lit_memtrain.models.lora import LoraSettings
from lit_memtrain.models.presets import build_config
from lit_memtrain.objectives.grpo import GRPOModule
from lit_memtrain.objectives.rloo import RLOOModule
from lit_memtrain.objectives.rollout import Rollout

OVERRIDES = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 16}
PROMPTS = [[1, 274, 201, 19, 293, 313, 33, 2, 201, 1, 276, 201], [1, 274, 201, 25, 33, 2, 201, 1, 276, 201]]
COMPLETIONS = [[40, 41, 2], [50, 51, 52, 53, 2], [60, 2], [70, 71, 72, 73]]


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory, tokenizer):
    from transformers import AutoModelForCausalLM

    directory = tmp_path_factory.mktemp("grpo-module-model")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(build_config("tiny-qwen3", {**OVERRIDES, "vocab_size": len(tokenizer)})) \
        .save_pretrained(directory)
    return str(directory)


def _prompts(count: int = 8) -> datasets.Dataset:
    return datasets.Dataset.from_list(
        [{"prompt": [{"role": "user", "content": f"What is {i} + {i + 1}?"}], "answer": str(2 * i + 1)}
         for i in range(count)]
    )


def _digits(completions, **kwargs):
    return [sum(ch.isdigit() for ch in c[-1]["content"]) / max(1, len(c[-1]["content"])) for c in completions]


def _token_sum(completion_ids, **kwargs):
    """A reward that differs between any two sampled completions, almost surely: every group has a gradient."""
    return [float(sum(ids) % 7) for ids in completion_ids]


def _module(saved_model: str | None = None, cls=GRPOModule, **kwargs) -> GRPOModule:
    source = {"model": saved_model} if saved_model else {"preset": "tiny-qwen3", "config_overrides": OVERRIDES}
    options = {"reward_funcs": [_digits], "num_generations": 2, "max_completion_length": 4, "learning_rate": 1e-2,
               "warmup": 0, "min_lr_ratio": 1.0, **kwargs}
    return cls(**source, tokenizer="lit-memtrain/embedded", **options)


def _attach_trainer(module: GRPOModule) -> GRPOModule:
    trainer = Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer.strategy.connect(module)
    module.trainer = trainer
    return module


class Record(Callback):
    def __init__(self) -> None:
        self.metrics: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.metrics.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("train/")})


def _fit(module: GRPOModule, max_steps: int = 2, callbacks=(), batch_size: int = 2, **trainer_options) -> Record:
    record = Record()
    trainer = Trainer(max_steps=max_steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=[*callbacks, record],
                      **trainer_options)
    trainer.fit(module, datamodule=PromptDataModule(dataset=_prompts(), batch_size=batch_size, seed=0))
    return record


def _rollout() -> Rollout:
    generator = torch.Generator().manual_seed(0)
    rollout = Rollout.of(PROMPTS * 2, COMPLETIONS, torch.ones(4, dtype=torch.bool))
    mask = rollout.completion_mask()
    return Rollout(rollout.prompt_ids, rollout.completion_ids, rollout.trained, rollout.width,
                   torch.tensor([1.0, -1.0, 0.5, -0.5]), -3 + torch.randn(4, rollout.width, generator=generator) * mask,
                   -3 + torch.randn(4, rollout.width, generator=generator) * mask)


def _grads(module: GRPOModule) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def test_padding_free_equals_padded_and_chunked_equals_plain_log_probabilities_and_entropies(saved_model):
    results = []
    for options in ({}, {"padding_free": False}, {"loss_type": "nll"}, {"loss_chunk_size": 3}):
        module = _attach_trainer(_module(saved_model, beta=0.1, temperature=0.7, policy_loss="grpo", **options))
        module.configure_model()
        rollout = _rollout()
        out = module.slice_loss(rollout, module.loss_normalizer(rollout))
        out.loss.backward()
        results.append((out.loss, _grads(module), out.entropy))
    (loss, grads, entropy), *others = results
    assert entropy.count_nonzero() == _rollout().completion_mask().count_nonzero()  # every trained token, only those
    for other_loss, other_grads, other_entropy in others:
        # the loss sums advantage x ratio (about 1) of either sign: at the advantages' magnitude, 1
        assert_equal_up_to_rounding(other_loss, loss, name="loss", terms=TINY_MODEL_TERMS, scale=1.0)
        assert_equal_up_to_rounding(other_entropy, entropy, name="entropy", terms=TINY_MODEL_TERMS)
        assert_each_equal_up_to_rounding(other_grads, grads, terms=TINY_MODEL_TERMS)


def test_lora_reference_is_the_base_model_with_the_adapter_disabled(saved_model):
    base = _attach_trainer(_module(saved_model))
    base.configure_model()
    rollout = _rollout()
    with torch.no_grad():
        expected = base.completion_logps(rollout)
    module = _attach_trainer(_module(saved_model, beta=0.1, lora=LoraSettings(r=4, alpha=8)))
    module.configure_model()
    with torch.no_grad():  # a trained adapter: the policy moves, the reference does not
        for name, param in module.model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.2)
        policy = module.completion_logps(rollout)
    assert_equal_up_to_rounding(module.reference_logps(rollout), expected, name="log-probs", terms=TINY_MODEL_TERMS)
    assert not torch.allclose(policy, expected, atol=1e-3)
    assert module._reference_model is None  # no copy


def test_the_frozen_reference_keeps_the_initial_weights_and_stays_out_of_checkpoints(saved_model):
    module = _module(saved_model, beta=0.1)
    record = _fit(module, max_steps=2)
    reference = module._reference_model
    assert reference is not None and not any(p.requires_grad for p in reference.parameters())
    fresh = _attach_trainer(_module(saved_model))
    fresh.configure_model()
    for (name, kept), original in zip(reference.named_parameters(), fresh.model.parameters()):
        assert torch.equal(kept, original), name
    assert any(not torch.equal(p, q) for p, q in zip(module.model.parameters(), fresh.model.parameters()))
    assert all(not key.startswith("_reference") for key in module.state_dict())
    assert len(record.metrics) == 2 and all("train/kl" in m for m in record.metrics)
    kl = record.metrics[0]["train/kl"]  # the first step's policy is the reference; exp(d) - d - 1 sums terms of 1
    assert_equal_up_to_rounding(kl, 0.0, name="train/kl", terms=TINY_MODEL_TERMS, scale=1.0)


@pytest.mark.parametrize(
    ("options", "max_steps", "batches", "off_policy"),
    [({"steps_per_generation": 2, "num_iterations": 2, "gradient_accumulation_steps": 2}, 4, 2, True),
     ({"gradient_accumulation_steps": 2, "steps_per_generation": 1}, 2, 4, False),
     ({"steps_per_generation": 2}, 4, 2, True)],
    ids=["iterations-and-slices", "accumulating-over-batches", "a-step-per-slice"],
)
def test_optimizer_steps_iterations_and_slices_follow_trl(saved_model, options, max_steps, batches, off_policy):
    module = _module(saved_model, reward_funcs=[_token_sum], **options)
    ratios: list[torch.Tensor] = []
    entropies: list[tuple[float, float]] = []  # each micro-batch's entropy summed over its trained tokens, and those
    slice_loss = module.slice_loss

    def recording(part, normalizer=None):
        out = slice_loss(part, normalizer)
        ratios.append(out.ratio[part.completion_mask().bool()])
        entropies.append((float(out.entropy.sum()), float(part.completion_mask().sum())))
        return out

    module.slice_loss = recording
    record = _fit(module, max_steps=max_steps)
    assert module.trainer.global_step == max_steps and len(record.metrics) == batches
    assert module.needs_old_logps == off_policy
    passes = module.steps_per_generation * module.hparams.num_iterations
    gas = module.hparams.gradient_accumulation_steps
    for index, ratio in enumerate(ratios):
        since_generation = index % passes
        before_a_step = since_generation < gas if off_policy else True
        if before_a_step:  # trained on the weights that sampled it: the importance ratio is 1
            torch.testing.assert_close(ratio, torch.ones_like(ratio), rtol=0, atol=1e-5)
        else:  # an optimizer step since: off-policy, rho moves away from 1
            assert (ratio - 1).abs().max() > 1e-4
    for batch, metrics in enumerate(record.metrics):  # the entropy over every token a generation batch trained
        passes_of_batch = entropies[batch * passes : (batch + 1) * passes]
        expected = sum(e for e, _ in passes_of_batch) / sum(n for _, n in passes_of_batch)
        assert_equal_up_to_rounding(metrics["train/entropy"], expected, name="train/entropy", terms=TINY_MODEL_TERMS)


def test_memory_callbacks_train_as_without_them(saved_model):
    runs = []
    offloading, in_effect = ActivationOffloading(offload_cpu_tensors_for_testing=True), TechniquesInEffect()
    for callbacks in ([], [GradientCheckpointing(), TiledMLP(num_tiles=2), offloading, in_effect]):
        torch.manual_seed(0)  # two slices a step, so two forwards and backwards: each is offloaded
        module = _module(saved_model, beta=0.1, steps_per_generation=2, gradient_accumulation_steps=2)
        record = _fit(module, max_steps=2, callbacks=callbacks)
        runs.append((record.metrics, {n: p.detach().clone() for n, p in module.model.named_parameters()}))
    in_effect.assert_in_effect(offloading=offloading)
    assert in_effect.backwards == 2 * 2  # two steps of two slices
    (metrics, weights), (other_metrics, other_weights) = runs
    for step, other in zip(metrics, other_metrics):  # the same completions, rewards and losses
        for name in ("train/reward", "train/completions/mean_length", "train/loss", "train/kl", "train/entropy"):
            assert other[name] == pytest.approx(step[name], rel=1e-4, abs=1e-6), name
    for name, weight in weights.items():
        torch.testing.assert_close(other_weights[name], weight, rtol=1e-3, atol=1e-3 * float(weight.abs().max()))


def test_rloo_trains_with_its_kl_penalty_and_validation_logs_rewards(saved_model):
    module = _module(saved_model, cls=RLOOModule, num_generations=3)
    assert module.hparams.beta == 0.05 and "policy_loss" not in module.hparams
    entropies: list[tuple[float, float]] = []  # each batch's entropy summed over its trained tokens, and those
    slice_loss = module.slice_loss

    def recording(part, normalizer=None):
        out = slice_loss(part, normalizer)
        entropies.append((float(out.entropy.sum()), float(part.completion_mask().sum())))
        return out

    module.slice_loss = recording
    record = Record()
    offloading, in_effect = ActivationOffloading(offload_cpu_tensors_for_testing=True), TechniquesInEffect()
    techniques = [GradientCheckpointing(), TiledMLP(num_tiles=2), offloading, in_effect]  # in effect for RLOO too
    trainer = Trainer(max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=[*techniques, record],
                      val_check_interval=2,
                      check_val_every_n_epoch=None, limit_val_batches=1)
    trainer.fit(module, datamodule=PromptDataModule(dataset=_prompts(), batch_size=2, val_size=2, seed=0))
    in_effect.assert_in_effect(offloading=offloading)
    kl = record.metrics[0]["train/kl"]  # exp(d) - d - 1 sums terms of about 1
    assert_equal_up_to_rounding(kl, 0.0, name="train/kl", terms=TINY_MODEL_TERMS, scale=1.0)
    assert all(torch.isfinite(torch.tensor(m["train/loss"])) for m in record.metrics)
    assert len(entropies) == len(record.metrics)  # one slice a batch
    for (entropy, tokens), metrics in zip(entropies, record.metrics):  # per token; RLOO's ratios are per completion
        per_token = entropy / tokens
        assert_equal_up_to_rounding(metrics["train/entropy"], per_token, name="train/entropy", terms=TINY_MODEL_TERMS)
    assert 0 <= float(trainer.callback_metrics["val/reward"]) <= 1
    assert "val/rewards/_digits/mean" in trainer.callback_metrics


class CountingGenerate(TransformersGenerate):
    calls = 0

    def generate(self, *args, **kwargs):
        CountingGenerate.calls += 1
        return super().generate(*args, **kwargs)


def test_bad_settings_and_batches_are_refused_before_any_work(saved_model):
    for bad, match in [({"num_generations": 1}, "num_generations must be an int >= 2"),
                       ({"policy_loss": "ppo"}, "policy_loss"), ({"scale_rewards": "rank"}, "scale_rewards"),
                       ({"generation_backend": "sglang"}, "generation_backend"), ({"beta": -1}, "beta"),
                       ({"temperature": 0}, "temperature"), ({"reward_weights": [1.0, 2.0]}, "reward_weights")]:
        with pytest.raises(ValueError, match=match):
            _module(saved_model, **bad)
    with pytest.raises(ValueError, match="needs a tokenizer"):
        GRPOModule(preset="tiny-qwen3", reward_funcs=[_digits])
    with pytest.raises(ValueError, match="policy_loss"):
        _module(saved_model, cls=RLOOModule, policy_loss="grpo")
    with pytest.raises(ValueError, match="Cannot import the reward function 'my_rewards.missing'"):
        _module(saved_model, reward_funcs=["my_rewards.missing"])
    backend = CountingGenerate(SamplingSettings(max_completion_length=4), [2], 0)
    module = _module(saved_model, steps_per_generation=3, generation_backend=backend)
    with pytest.raises(ValueError, match=r"2 prompts x num_generations=2 = 4 completions cannot be split into "
                                         r"steps_per_generation=3"):
        _fit(module)
    assert CountingGenerate.calls == 0


class NamedScorer:
    """A callable object, as a reward model is: logged under its ``name``, not importable back from hparams."""

    name = "reward_model"

    def __call__(self, prompts, completions, **kwargs):
        return [0.5] * len(completions)


def test_reward_functions_by_import_path_and_as_named_objects(saved_model):
    module = _module(saved_model, reward_funcs=["lit_memtrain.objectives.arithmetic_rewards.exact_answer",
                                                NamedScorer()])
    assert module.reward_functions.names == ["exact_answer", "reward_model"]
    assert module.hparams.reward_funcs[0] == "lit_memtrain.objectives.arithmetic_rewards.exact_answer"
    with pytest.raises(ValueError, match="pass it again as reward_funcs"):
        _module(saved_model, reward_funcs=module.hparams.reward_funcs)  # what loading its checkpoint would do


def _raises(completions, **kwargs):
    return [1 / 0 for _ in completions]


def _one_short(completions, **kwargs):
    return [0.0] * (len(completions) - 1)


def _words(completions, **kwargs):
    return ["good"] * len(completions)


@pytest.mark.parametrize(
    ("function", "error", "match"),
    [(_raises, RuntimeError, "The reward function '_raises' raised ZeroDivisionError on training batch 0"),
     (_one_short, ValueError, "The reward function '_one_short' returned 3 rewards on training batch 0 .* but 4 were "
                              "expected"),
     (_words, ValueError, r"The reward function '_words' returned a str \('good'\) where a number or None was "
                          "expected for completion 0 of training batch 0")],
)
def test_reward_function_errors_name_the_function_and_the_batch(saved_model, function, error, match):
    with pytest.raises(error, match=match):
        _fit(_module(saved_model, reward_funcs=[_digits, function]))
