"""TRL 1.16's loss variants and token controls in GRPOModule against ``GRPOTrainer._compute_loss`` (fp32, CPU).

Each case sets the same options under the same names on both sides (``loss_type`` is ``policy_loss`` here) and
compares one micro-batch's loss, the gradients of every parameter and what TRL logs of it, on the fixtures of
test_grpo_trl.py: the same tiny model, prompts and completions, with perturbed sampling log-probabilities so that
clips, caps and masks bind. Adaptive entropy control is compared over two optimizer steps; ``normalize_then_sum``
over a generation batch (in test_grpo_trl.py); one variant runs through a real Lightning Trainer.
"""

from __future__ import annotations

import pytest
import torch
from equivalence import TINY_MODEL_TERMS, assert_equal_up_to_rounding
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import CSVLogger
from test_grpo_trl import (  # noqa: F401 (saved_model: the fixture)
    COMPLETIONS,
    G,
    MAX_COMPLETION_LENGTH,
    _assert_same_grads,
    _grads,
    _module,
    _prompt_ids,
    _prompts,
    _trl_inputs,
    _trl_logps,
    _zero_reward,
    saved_model,
)

from lit_memtrain.objectives.grpo import GRPOModule
from lit_memtrain.objectives.rollout import Rollout

ADVANTAGES = torch.tensor([1.0, -1.0, 0.5, -0.5, -1.2, 1.2])

# (TRL's loss_type, beta, options under TRL's names): every variant of issue 38, and the token controls combined.
VARIANTS = {
    "gspo": ("grpo", 0.0, {"importance_sampling_level": "sequence"}),
    "gspo-kl": ("grpo", 0.1, {"importance_sampling_level": "sequence", "epsilon": 3e-4, "epsilon_high": 4e-4}),
    "cispo": ("cispo", 0.0, {"epsilon_high": 1.1}),
    "sapo": ("sapo", 0.0, {"sapo_temperature_pos": 1.5, "sapo_temperature_neg": 2.0}),
    "luspo": ("luspo", 0.0, {"importance_sampling_level": "sequence", "epsilon": 3e-4, "epsilon_high": 4e-4}),
    "vespo": ("vespo", 0.1, {"vespo_k_pos": 1.5, "vespo_lambda_pos": 2.5}),
    "delta": ("dapo", 0.0, {"delta": 1.1}),
    "kl-without-bias-correction": ("dapo", 0.1, {"use_bias_correction_kl": False}),
    "off-policy-mask": ("dapo", 0.0, {"off_policy_mask_threshold": 0.02}),
    "top-entropy": ("grpo", 0.0, {"top_entropy_quantile": 0.2}),
    "entropy-bonus": ("dapo", 0.1, {"entropy_coef": 0.05}),
    "entropy-bonus-top-entropy": ("bnpo", 0.0, {"entropy_coef": 0.05, "top_entropy_quantile": 0.5}),
    "entropy-bonus-nll": ("dapo", 0.0, {"entropy_coef": 0.05}),  # the entropy of the model's logits (loss_type nll)
}
HOUSE_OPTIONS = {"entropy-bonus-nll": {"loss_type": "nll"}}  # ours alone: how the tokens are scored


def _trl_trainer(saved_model, tokenizer, tmp_path, loss_type, beta, options):
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    options = {"epsilon": 0.2, "epsilon_high": 0.28, **options}
    config = GRPOConfig(
        output_dir=str(tmp_path), use_cpu=True, bf16=False, disable_dropout=True, report_to=[], loss_type=loss_type,
        beta=beta, temperature=0.7, per_device_train_batch_size=len(COMPLETIONS), num_generations=G,
        max_completion_length=MAX_COMPLETION_LENGTH, **options,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(saved_model, attn_implementation="sdpa")
    trl = GRPOTrainer(model=model, reward_funcs=_zero_reward, args=config, train_dataset=_prompts(),
                      processing_class=tokenizer)  # fmt: skip
    model.train()
    trl.current_gradient_accumulation_steps = 1
    return trl, model, options


def _inputs(trl, model, tokenizer):
    """TRL's inputs, and the same completions as our rollout, with sampling log-probabilities 0.3 nats off."""
    prompt_ids = _prompt_ids(tokenizer)
    inputs = _trl_inputs(prompt_ids, tokenizer.pad_token_id)
    mask = inputs["completion_mask"].float()
    logps = _trl_logps(trl, model, inputs)
    generator = torch.Generator().manual_seed(1)
    old = (logps + 0.3 * torch.randn(logps.shape, generator=generator)) * mask
    ref = (logps + 0.2 * torch.randn(logps.shape, generator=generator)) * mask
    inputs.update(advantages=ADVANTAGES, num_items_in_batch=mask.sum(), old_per_token_logps=old)
    if trl.beta:
        inputs["ref_per_token_logps"] = ref
    rollout = Rollout(prompt_ids, COMPLETIONS, torch.ones(len(COMPLETIONS), dtype=torch.bool),
                      max(map(len, COMPLETIONS)), ADVANTAGES, old, ref if trl.beta else None)  # fmt: skip
    return inputs, rollout, logps


def _masked_mean(value: torch.Tensor, rollout: Rollout) -> float:
    """What TRL logs of a per-token ``[B, T]`` or per-completion ``[B]`` value."""
    if value.dim() == 1:
        return float(value.float().mean())
    mask = rollout.completion_mask()
    return float((value.float() * mask).sum() / mask.sum())


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_each_loss_variant_equals_trl_compute_loss(saved_model, tokenizer, tmp_path, variant):
    loss_type, beta, options = VARIANTS[variant]
    trl, trl_model, options = _trl_trainer(saved_model, tokenizer, tmp_path, loss_type, beta, options)
    inputs, rollout, logps = _inputs(trl, trl_model, tokenizer)
    trl_loss = trl._compute_loss(trl_model, inputs)
    trl_loss.backward()

    module = _module(saved_model, policy_loss=loss_type, beta=beta, temperature=0.7, num_generations=G,
                     max_completion_length=MAX_COMPLETION_LENGTH, **options, **HOUSE_OPTIONS.get(variant, {}))
    out = module.slice_loss(rollout, module.loss_normalizer(rollout))
    out.loss.backward()
    # The loss sums advantage x weight (about 1), or x log-probability (cispo, vespo), of either sign.
    scale = float(ADVANTAGES.abs().max()) * max(1.0, float(logps.abs().max()))
    assert_equal_up_to_rounding(out.loss, trl_loss, name="loss", terms=TINY_MODEL_TERMS, scale=scale)
    _assert_same_grads(_grads(module), trl_model)

    logged = trl._metrics["train"]
    if out.low_clipped is not None:
        assert _masked_mean(out.low_clipped, rollout) == pytest.approx(logged["clip_ratio/low_mean"][-1])
        assert _masked_mean(out.high_clipped, rollout) == pytest.approx(logged["clip_ratio/high_mean"][-1])
        assert out.low_clipped.any() or out.high_clipped.any(), "the perturbation made no clip bind"
    else:
        assert "clip_ratio/low_mean" not in logged
    for name, value in out.means.items():
        assert_equal_up_to_rounding(
            _masked_mean(value, rollout), logged[name][-1], name=name, terms=TINY_MODEL_TERMS, scale=1.0
        )
    assert set(out.means) == {name for name in ("cispo_clip_ratio", "vespo/phi_seq_mean") if name in logged}
    if "entropy_coef" in options:
        assert_equal_up_to_rounding(out.policy_loss, logged["policy_loss"][-1], name="policy loss",
                                    terms=TINY_MODEL_TERMS, scale=scale)  # fmt: skip
    if loss_type == "cispo":
        assert 0 < logged["cispo_clip_ratio"][-1] < 1  # the bound binds on some tokens, not all
    if "top_entropy_quantile" in options:  # the mask kept some trained tokens and dropped others
        assert out.loss.item() != 0.0


def test_the_off_policy_mask_and_the_entropy_mask_drop_something(saved_model, tokenizer, tmp_path):
    """The masks the variants above compare do bind on those inputs: without them the loss differs."""
    trl, trl_model, _ = _trl_trainer(saved_model, tokenizer, tmp_path, "dapo", 0.0, {})
    _, rollout, _ = _inputs(trl, trl_model, tokenizer)
    losses = {}
    for name, options in [("plain", {}), ("mask", {"off_policy_mask_threshold": 0.02}),
                          ("entropy", {"top_entropy_quantile": 0.2})]:  # fmt: skip
        module = _module(saved_model, policy_loss="dapo", temperature=0.7, num_generations=G,
                         max_completion_length=MAX_COMPLETION_LENGTH, epsilon=0.2, epsilon_high=0.28, **options)
        with torch.no_grad():
            losses[name] = float(module.slice_loss(rollout, module.loss_normalizer(rollout)).loss)
    assert losses["mask"] != pytest.approx(losses["plain"]) and losses["entropy"] != pytest.approx(losses["plain"])


def test_adaptive_entropy_control_equals_trl_over_two_optimizer_steps(saved_model, tokenizer, tmp_path):
    """No bonus before the first measurement; after an optimizer step the coefficient moves by
    ``entropy_coef_delta`` toward the target and applies while the measured entropy is at or below it."""
    options = {"entropy_coef": 0.02, "use_adaptive_entropy": True, "entropy_target": 100.0, "entropy_coef_delta": 0.01}
    trl, trl_model, options = _trl_trainer(saved_model, tokenizer, tmp_path, "dapo", 0.0, options)
    module = _module(saved_model, policy_loss="dapo", temperature=0.7, num_generations=G,
                     max_completion_length=MAX_COMPLETION_LENGTH, **options)  # fmt: skip
    inputs, rollout, logps = _inputs(trl, trl_model, tokenizer)
    scale = float(ADVANTAGES.abs().max())
    for step in range(2):
        trl_model.zero_grad()
        module.zero_grad()
        trl_loss = trl._compute_loss(trl_model, inputs)  # one micro-batch per optimizer step: TRL updates here
        trl_loss.backward()
        out = module.slice_loss(rollout, module.loss_normalizer(rollout))
        out.loss.backward()
        module.entropy_bonus.end_step(lambda totals: totals)  # what the optimizer step does, on one process
        assert_equal_up_to_rounding(out.loss, trl_loss, name=f"loss {step}", terms=TINY_MODEL_TERMS, scale=scale)
        _assert_same_grads(_grads(module), trl_model)
        assert module.entropy_bonus.coef == pytest.approx(trl.entropy_coef)
        assert module.entropy_bonus.last_entropy == pytest.approx(trl._last_world_entropy, rel=1e-5)
    assert module.entropy_bonus.coef == pytest.approx(0.04)  # raised twice: the entropy is below the target
    assert float(out.loss.detach()) != pytest.approx(float(out.policy_loss))  # the second step has a bonus


LIGHTNING_RUNS = {  # a variant per family of metrics: the clipped losses', cispo's
    "gspo-entropy": ({"policy_loss": "grpo", "importance_sampling_level": "sequence", "entropy_coef": 0.01,
                      "top_entropy_quantile": 0.5},
                     ("clip_ratio/low_mean", "clip_ratio/high_max", "entropy", "policy_loss", "entropy_coef", "loss")),
    "cispo": ({"policy_loss": "cispo", "epsilon_high": 1.1}, ("cispo_clip_ratio", "entropy", "loss")),
}  # fmt: skip


@pytest.mark.parametrize("run", list(LIGHTNING_RUNS))
def test_a_variant_trains_through_a_lightning_trainer_and_logs_trls_names(saved_model, tmp_path, run):
    """Optimizer steps are taken, the model changes, and the metrics TRL logs for the variant are logged under
    TRL's names, finite (and the clip ratios only for the clipped losses, as TRL)."""
    from test_grpo_trl import FixedCompletions
    from transformers import AutoModelForCausalLM

    from lit_memtrain.datamodules.prompts import PromptDataModule
    from lit_memtrain.models.generation import SamplingSettings

    def length_reward(completion_ids, **kwargs):
        return [float(len(ids)) for ids in completion_ids]

    options, names = LIGHTNING_RUNS[run]
    backend = FixedCompletions(SamplingSettings(MAX_COMPLETION_LENGTH, temperature=0.7), [2], 0)
    module = GRPOModule(
        model=saved_model, tokenizer="lit-memtrain/embedded", reward_funcs=[length_reward], num_generations=G,
        max_completion_length=MAX_COMPLETION_LENGTH, temperature=0.7, generation_backend=backend, num_iterations=2,
        learning_rate=1e-3, **options,
    )  # fmt: skip
    datamodule = PromptDataModule(dataset=_prompts(), batch_size=3, max_prompt_length=None)
    trainer = Trainer(accelerator="cpu", max_steps=2, logger=CSVLogger(tmp_path), enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1)  # fmt: skip
    trainer.fit(module, datamodule=datamodule)
    assert trainer.global_step == 2
    logged = trainer.logged_metrics
    for name in names:
        assert f"train/{name}" in logged and torch.isfinite(logged[f"train/{name}"]), name
    assert ("train/clip_ratio/low_mean" in logged) == (options["policy_loss"] != "cispo")
    if "entropy_coef" in options:
        assert float(logged["train/entropy_coef"]) == pytest.approx(options["entropy_coef"])
    initial = AutoModelForCausalLM.from_pretrained(saved_model).state_dict()
    trained = module.model.state_dict()
    assert any(not torch.equal(trained[name], initial[name]) for name in initial)  # the steps trained the model


@pytest.mark.parametrize(
    ("options", "message"),
    [({"importance_sampling_level": "sentence"}, "importance_sampling_level must be one of"),
     ({"delta": 0.9}, "delta .* must be > 1"),
     ({"sapo_temperature_neg": 0.0}, "sapo_temperature_neg must be > 0"),
     ({"top_entropy_quantile": 1.5}, r"top_entropy_quantile must be in \[0, 1\]"),
     ({"entropy_coef": float("nan")}, "entropy_coef must be a finite number"),
     ({"use_adaptive_entropy": True, "entropy_coef_min": 0.5, "entropy_coef_max": 0.1}, "entropy_coef_min <="),
     ({"multi_objective_aggregation": "sum"}, "multi_objective_aggregation must be one of"),
     ({"policy_loss": "ppo"}, "policy_loss .* must be one of")],
)
def test_bad_variant_options_are_refused_at_construction(options, message):
    with pytest.raises(ValueError, match=message):
        GRPOModule(reward_funcs=[len], preset="tiny-qwen3", tokenizer="lit-memtrain/embedded", **options)


def test_trls_warnings_for_combinations_its_papers_do_not_train():
    with pytest.warns(UserWarning, match="luspo.*'sequence'"):
        GRPOModule(reward_funcs=[len], preset="tiny-qwen3", tokenizer="lit-memtrain/embedded", policy_loss="luspo")
    with pytest.warns(UserWarning, match="weighting each completion by its length"):
        GRPOModule(reward_funcs=[len], preset="tiny-qwen3", tokenizer="lit-memtrain/embedded",
                   importance_sampling_level="sequence")  # fmt: skip


def test_the_adaptive_entropy_state_goes_into_checkpoints(saved_model):
    module = _module(saved_model, entropy_coef=0.02, use_adaptive_entropy=True)
    module.entropy_bonus.observe(torch.tensor(3.0), torch.tensor(2.0))
    module.entropy_bonus.end_step(lambda totals: totals)  # entropy 1.5 > target 0.2: the coefficient drops
    checkpoint = {"state_dict": {}}
    module.on_save_checkpoint(checkpoint)
    resumed = _module(saved_model, entropy_coef=0.02, use_adaptive_entropy=True)
    resumed.on_load_checkpoint(checkpoint)
    assert (resumed.entropy_bonus.coef, resumed.entropy_bonus.last_entropy) == (pytest.approx(0.015), 1.5)
