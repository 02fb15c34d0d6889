"""OnlineDPOModule through fits and its public step: padding-free equals padded, the LoRA reference, a pairwise
judge, beta per epoch, and clear errors (bad settings before any work; a judge that raises or answers wrongly, and
completions that never end, naming the batch)."""

from __future__ import annotations

import datasets
import pytest
import torch
from equivalence import TINY_MODEL_TERMS, assert_each_equal_up_to_rounding, assert_equal_up_to_rounding
from lightning.pytorch import Callback, Trainer
from tiny_models import TINY_OVERRIDES, save_tiny_causal_lm

from lit_memtrain.datamodules.prompts import PromptDataModule
from lit_memtrain.models.lora import LoraSettings
from lit_memtrain.models.presets import build_config
from lit_memtrain.objectives.online_dpo import OnlineDPOModule
from lit_memtrain.objectives.rollout import Rollout

PROMPTS = [[1, 274, 201, 19, 293, 313, 33, 2, 201, 1, 276, 201], [1, 274, 201, 25, 33, 2, 201, 1, 276, 201]]
COMPLETIONS = [[40, 41, 2], [50, 51, 52, 53, 2], [60, 2], [70, 71, 72, 73]]


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory, tokenizer):
    return save_tiny_causal_lm(tmp_path_factory.mktemp("online-dpo-module-model"), tokenizer)


def _prompts(count: int = 4) -> datasets.Dataset:
    return datasets.Dataset.from_list(
        [{"prompt": [{"role": "user", "content": f"What is {i} + {i + 1}?"}], "answer": str(2 * i + 1)}
         for i in range(count)]
    )


def _token_sum(completion_ids, **kwargs):
    return [float(sum(ids) % 7) for ids in completion_ids]


class PrefersShorter:
    """TRL's ``BasePairwiseJudge`` shape: ``judge(prompts, completions)`` -> the index of the better of each pair."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    def judge(self, prompts, completions, shuffle_order=True):
        self.calls.append((len(prompts), len(completions)))
        return [int(len(second[-1]["content"]) < len(first[-1]["content"])) for first, second in completions]


def _module(saved_model: str, **kwargs) -> OnlineDPOModule:
    options = {"reward_funcs": [_token_sum], "max_new_tokens": 4, "max_length": 64, "learning_rate": 1e-2,
               "warmup": 0, "min_lr_ratio": 1.0, "beta": 0.5, **kwargs}
    if "judge" in kwargs:
        del options["reward_funcs"]
    return OnlineDPOModule(model=saved_model, tokenizer="lit-memtrain/embedded", **options)


def _attach_trainer(module: OnlineDPOModule) -> OnlineDPOModule:
    trainer = Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer.strategy.connect(module)
    module.trainer = trainer
    module.configure_model()
    return module


class Record(Callback):
    def __init__(self) -> None:
        self.metrics: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.metrics.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("train/")})


def _fit(module: OnlineDPOModule, batch_size: int = 2, **trainer_options) -> Record:
    record = Record()
    trainer = Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, callbacks=[record], **{"max_steps": 2, **trainer_options})
    trainer.fit(module, datamodule=PromptDataModule(dataset=_prompts(), batch_size=batch_size, seed=0))
    return record


def _rollout() -> Rollout:
    return Rollout.of([PROMPTS[0], PROMPTS[0], PROMPTS[1], PROMPTS[1]], COMPLETIONS, torch.ones(4, dtype=torch.bool))


def _step(module: OnlineDPOModule) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    with torch.no_grad():  # a trained policy: not its reference
        for _, parameter in sorted(module.model.named_parameters()):
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=torch.Generator().manual_seed(1)))
    truncated = torch.tensor([False, False, False, True])
    loss, metrics = module.pair_step(_rollout(), torch.tensor([1.0, 3.0, 2.0, 0.0]), truncated)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    return loss, metrics, grads


@pytest.mark.parametrize("preference_loss", ["sigmoid", "ipo"])
def test_padding_free_equals_padded_and_chunked_equals_plain(saved_model, preference_loss):
    results = [_step(_attach_trainer(_module(saved_model, preference_loss=preference_loss, **options)))
               for options in ({}, {"padding_free": False}, {"loss_type": "nll"})]
    (loss, metrics, grads), *others = results
    assert float(metrics["rewards/margins"]) != 0 and float(metrics["rewards/accuracies"]) in (0.0, 0.5, 1.0)
    for other_loss, other_metrics, other_grads in others:
        assert_equal_up_to_rounding(other_loss, loss, name="loss", terms=TINY_MODEL_TERMS, scale=max(1.0, float(loss)))
        for name in ("logps/chosen", "rewards/margins", "objective/kl"):
            assert_equal_up_to_rounding(other_metrics[name], metrics[name], name=name, terms=TINY_MODEL_TERMS,
                                        scale=max(1.0, abs(float(metrics[name]))))
        assert_each_equal_up_to_rounding(other_grads, grads, terms=TINY_MODEL_TERMS)


def test_lora_reference_is_the_base_model_and_a_pairwise_judge_trains(saved_model):
    judge = PrefersShorter()
    module = _module(saved_model, judge=judge, lora=LoraSettings(r=4, alpha=8), max_new_tokens=5)
    record = _fit(module)
    assert module._reference_model is None  # no copy: the adapter disabled is the reference
    assert module.hparams.judge == "<a PrefersShorter object: pass it again as judge>"  # what checkpoints hold
    assert judge.calls == [(2, 2), (2, 2)]  # each step: its 2 prompts and their 2 pairs
    first, last = record.metrics[0], record.metrics[-1]
    assert first["train/objective/kl"] == 0.0  # B = 0 at the start: the policy is the base model
    assert last["train/objective/kl"] != 0.0 and last["train/beta"] == 0.5
    assert "train/objective/scores" not in last  # a judge gives no score


def test_beta_is_taken_per_epoch(saved_model):
    record = _fit(_module(saved_model, beta=[0.5, 0.25]), max_steps=-1, max_epochs=3)
    assert [m["train/beta"] for m in record.metrics] == [0.5, 0.5, 0.25, 0.25, 0.25, 0.25]


def test_bad_settings_are_refused_before_any_work(saved_model):
    for bad, match in [({"judge": PrefersShorter(), "reward_funcs": [_token_sum]}, "either reward_funcs .* not both"),
                       ({"reward_funcs": None}, "not neither"),
                       ({"judge": PrefersShorter(), "reward_funcs": None, "missing_eos_penalty": 1.0},
                        "a pairwise judge gives none"),
                       ({"beta": 0.0}, "beta must be > 0"), ({"beta": []}, "beta must be > 0"),
                       ({"preference_loss": "hinge"}, "preference_loss"),
                       ({"max_length": 4}, "max_length .* above max_new_tokens=4"),
                       ({"missing_eos_penalty": -1.0}, "missing_eos_penalty must be >= 0")]:
        options = {"reward_funcs": [_token_sum], **bad}
        with pytest.raises(ValueError, match=match):
            OnlineDPOModule(model=saved_model, tokenizer="lit-memtrain/embedded", max_new_tokens=4, **options)


def _raises(prompts, completions):
    raise KeyError("no score")


def _too_few(prompts, completions):
    return [0] * (len(completions) - 1)


def _not_an_index(prompts, completions):
    return [0, 2][: len(completions)]


@pytest.mark.parametrize(
    ("judge", "error", "match"),
    [(_raises, RuntimeError, "The judge '_raises' raised KeyError on training batch 0 .*no score"),
     (_too_few, ValueError, "The judge '_too_few' returned 1 values on training batch 0 .* but 2 were expected"),
     (_not_an_index, ValueError, "The judge '_not_an_index' returned 2 for pair 1 of training batch 0")],
)
def test_judge_errors_name_the_judge_and_the_batch(saved_model, judge, error, match):
    with pytest.raises(error, match=match):
        _fit(_module(saved_model, judge=judge))


def test_completions_that_never_end_are_reported_with_the_count_penalised(saved_model):
    module = _module(saved_model, missing_eos_penalty=2.0, max_new_tokens=2)  # a random model ends none in 2 tokens
    with pytest.warns(UserWarning, match=r"None of the 4 completions of training batch 0 \(.*\) ended within "
                      r"max_new_tokens=2 .* missing_eos_penalty=2.0 lowered all 4 scores"):
        record = _fit(module, max_steps=1)
    assert record.metrics[0]["train/val/contain_eos_token"] == 0.0


def _one(completions, **kwargs):
    return [1.0] * len(completions)


def test_validation_logs_the_penalised_scores_over_the_validation_prompts(saved_model):
    module = _module(saved_model, reward_funcs=[_one], missing_eos_penalty=2.0, max_new_tokens=2)  # none ends
    trainer = Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, val_check_interval=1,
                      check_val_every_n_epoch=None, limit_val_batches=1)
    with pytest.warns(UserWarning, match="None of the"):
        trainer.fit(module, datamodule=PromptDataModule(dataset=_prompts(), batch_size=2, val_size=2, seed=0))
    assert float(trainer.callback_metrics["val/objective/scores"]) == 1.0 - 2.0
    assert float(trainer.callback_metrics["val/contain_eos_token"]) == 0.0


def test_grpo_options_trls_online_dpo_config_lacks_are_refused(saved_model):
    for name, value in [("cast_lm_head_to_fp32", True), ("sync_ref_model", True), ("num_generations_eval", 2),
                        ("generation_batch_size", 4), ("vllm_importance_sampling_correction", False)]:
        with pytest.raises(ValueError, match=rf"\['{name}'\] are GRPO options .*OnlineDPOConfig does not"):
            _module(saved_model, **{name: value})


def test_dropout_is_disabled_by_default_as_trls_online_dpo_config_and_generation_kwargs_reach_sampling(saved_model):
    lora = LoraSettings(r=2, alpha=4, dropout=0.3)
    for disable_dropout, expected in [(True, {0.0}), (False, {0.3})]:
        module = _attach_trainer(_module(saved_model, lora=lora, disable_dropout=disable_dropout))
        assert {m.p for m in module.model.modules() if isinstance(m, torch.nn.Dropout)} == expected
    assert _module(saved_model, generation_kwargs={"no_repeat_ngram_size": 2}).sampling.generation_kwargs == {
        "no_repeat_ngram_size": 2
    }


def test_an_epochs_last_shorter_accumulation_window_steps_and_the_schedule_counts_it(saved_model):
    """3 batches an epoch, gradient_accumulation_steps=2: windows {0, 1} and {2} of each epoch, as the Hugging Face
    Trainer steps at an epoch's end."""
    module = _module(saved_model, gradient_accumulation_steps=2)
    trainer = Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, max_epochs=2)
    trainer.fit(module, datamodule=PromptDataModule(dataset=_prompts(3), batch_size=1, seed=0))
    assert trainer.global_step == 4
    assert module.estimated_optimizer_steps() == 4


def test_a_mixture_of_experts_model_is_refused_at_fit_start_as_trl_adds_no_router_loss(tmp_path, tokenizer):
    from transformers import AutoModelForCausalLM

    moe = {"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
           "router_aux_loss_coef": 0.5}
    config = build_config("tiny-qwen3", {**TINY_OVERRIDES, **moe, "vocab_size": len(tokenizer)})
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"has routers: OnlineDPOModule does not add .*router_aux_loss_coef=0"):
        _fit(_module(str(tmp_path)), max_steps=1)
