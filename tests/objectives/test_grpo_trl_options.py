"""Options of TRL 1.16's GRPOConfig against TRL on the CPU in fp32.

- The vLLM importance-sampling correction: a generation batch whose engine log-probabilities differ from the
  trainer's gives TRL's ratios (every mode, a lower bound too) and ``sampling/`` metrics
  (``_generate_and_score_completions``), and then TRL's loss and gradients (``_compute_loss``); through a fit, the
  correction is on by default with a backend that reports log-probabilities, RLOO refuses it, bad settings are
  refused.
- A mixture-of-experts model: the router load-balancing loss added as TRL adds it (loss and gradients), GRPO and RLOO.
"""

from __future__ import annotations

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

OVERRIDES = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
             "num_key_value_heads": 1, "head_dim": 16}
QUESTIONS = ["What is 12 + 30?", "Reverse the word cat.", "What is 7 + 8 + 9?"]
G, EOS, LENGTH = 2, 2, 6
COMPLETIONS = [[40, 41, EOS], [50, 51, 52, 53, EOS], [60, EOS], [70, 71, 72, 73, 74, 75], [80, 81, 82, EOS], [90, EOS]]
METRICS = ["sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max",
           "sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/mean",
           "sampling/importance_sampling_ratio/max"]


class EngineCompletions(GenerationBackend):
    """The test's completions, with the log-probabilities an engine reports for them: ``logprobs``."""

    def __init__(self, *args, logprobs: list[list[float]] | None) -> None:
        super().__init__(*args)
        self.logprobs = logprobs

    def generate(self, model, prompt_ids, num_generations, device, weights_version):
        self.sampling_logprobs = None if self.logprobs is None else [list(row) for row in self.logprobs]
        return [list(c) for c in COMPLETIONS][: len(prompt_ids) * num_generations]


def _prompts() -> datasets.Dataset:
    return datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": q}]} for q in QUESTIONS])


def _tokens_reward(completion_ids, **kwargs):
    return [float(ids[0] % 7) + len(ids) for ids in completion_ids]


MOE = {"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
       "router_aux_loss_coef": 0.5, "output_router_logits": False}


@pytest.fixture(scope="module")
def saved_models(tmp_path_factory, tokenizer) -> dict[str, str]:
    """Directories of a dense and a mixture-of-experts tiny model, the same seed."""
    from transformers import AutoModelForCausalLM

    directories = {}
    for name, overrides in (("dense", {}), ("moe", MOE)):
        directories[name] = str(tmp_path_factory.mktemp(f"{name}-model"))
        torch.manual_seed(0)
        config = build_config("tiny-qwen3", {**OVERRIDES, **overrides, "vocab_size": len(tokenizer)})
        AutoModelForCausalLM.from_config(config).save_pretrained(directories[name])
    return directories


def _trl(cls, directory: str, tokenizer, tmp_path, completions_logprobs, **options):
    """TRL's trainer of ``cls``'s algorithm on the model in ``directory``, generating the test's completions (with
    ``completions_logprobs`` as vLLM's log-probabilities, GRPO only)."""
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

    grpo = cls is GRPOModule
    Config, TrainerClass = (GRPOConfig, GRPOTrainer) if grpo else (RLOOConfig, RLOOTrainer)
    config = Config(output_dir=str(tmp_path), use_cpu=True, bf16=False, disable_dropout=True, report_to=[],
                    per_device_train_batch_size=len(COMPLETIONS), num_generations=G, max_completion_length=LENGTH,
                    temperature=0.7, **options)  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="sdpa")
    trl = TrainerClass(model=model, reward_funcs=[_tokens_reward], args=config, train_dataset=_prompts(),
                       processing_class=tokenizer)  # fmt: skip
    completions = [list(c) for c in COMPLETIONS]
    trl._generate_single_turn = (lambda *a, **k: (completions, completions_logprobs)) if grpo else (
        lambda *a, **k: completions)  # fmt: skip
    trl.current_gradient_accumulation_steps = 1  # set by the Trainer in a training loop
    model.train()
    return trl, model


def _batch() -> dict:
    datamodule = PromptDataModule(dataset=_prompts(), batch_size=len(QUESTIONS))
    datamodule.setup("fit")
    return datamodule.collator()([datamodule.datasets["train"][i] for i in range(len(QUESTIONS))])


def _module(saved_model: str, backend: GenerationBackend, cls=GRPOModule, **options) -> GRPOModule:
    module = cls(model=saved_model, tokenizer="lit-memtrain/embedded", reward_funcs=[_tokens_reward],
                 num_generations=G, max_completion_length=LENGTH, temperature=0.7, generation_backend=backend,
                 **options)  # fmt: skip
    module.configure_model()
    trainer = Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer.strategy.connect(module)
    module.trainer = trainer
    return module


def _engine_logprobs(module: GRPOModule, prompt_ids: list[list[int]], seed: int) -> list[list[float]]:
    """The trainer's log-probabilities of the completions, each token moved by up to about +-1 (vLLM's differ)."""
    rollout = Rollout.of([ids for ids in prompt_ids for _ in range(G)], COMPLETIONS, torch.ones(len(COMPLETIONS)))
    with torch.no_grad():
        logps = module.completion_logps(rollout)
    noise = 0.5 * torch.randn(logps.shape, generator=torch.Generator().manual_seed(seed))
    return [(logps[i, : len(c)] + noise[i, : len(c)]).tolist() for i, c in enumerate(COMPLETIONS)]


def _assert_trls_loss_and_gradients(module: GRPOModule, rollout: Rollout, trl_loss, trl_model) -> None:
    """The slice's loss (a sum of advantage x ratio up to 3, of either sign) and its gradients are TRL's."""
    out = module.slice_loss(rollout, module.loss_normalizer(rollout))
    out.loss.backward()
    assert_equal_up_to_rounding(out.loss, trl_loss, name="loss", terms=TINY_MODEL_TERMS, scale=3.0)
    ours = {n: p.grad for n, p in module.model.named_parameters() if p.grad is not None}
    assert_each_equal_up_to_rounding(ours, {n: p.grad for n, p in trl_model.named_parameters()},
                                     terms=TINY_MODEL_TERMS)  # fmt: skip


@pytest.mark.parametrize(("mode", "clip_min", "loss"), [
    ("sequence_mask", None, "dapo"), ("sequence_truncate", 0.5, "dapo"), ("token_mask", 0.7, "dapo"),
    ("token_truncate", 0.7, "dapo"),
    ("sequence_mask", None, "vespo"), ("token_truncate", 0.7, "vespo"),  # vespo takes the ratio into its weights
])  # fmt: skip
def test_ratios_metrics_loss_and_gradients_equal_trls(saved_models, tokenizer, tmp_path, mode, clip_min, loss):
    options = {"vllm_importance_sampling_mode": mode, "vllm_importance_sampling_clip_min": clip_min}
    batch = _batch()
    module = _module(saved_models["dense"], EngineCompletions(SamplingSettings(LENGTH, temperature=0.7), [EOS], 0,
                                                    logprobs=[]), policy_loss=loss, **options)  # fmt: skip
    logprobs = _engine_logprobs(module, batch["prompt_ids"], seed=3)
    module.generation_backend.logprobs = logprobs

    trl, trl_model = _trl(GRPOModule, saved_models["dense"], tokenizer, tmp_path, logprobs, loss_type=loss, **options)
    trl.use_vllm = True  # all the correction reads of it: generation is the test's
    expected = trl._generate_and_score_completions([{"prompt": p} for p in _prompts()["prompt"] for _ in range(G)])
    trl_loss = trl._compute_loss(trl_model, expected)
    trl_loss.backward()

    rollout, rewards, _ = module.generate_rollout(batch, "a test batch")
    rollout, metrics = module.prepare_rollout(rollout, rewards)
    theirs = expected["importance_sampling_ratio"]
    ours = rollout.sampling_ratio
    if mode.startswith("token"):
        theirs, ours = theirs * expected["completion_mask"], ours * rollout.completion_mask()
    assert ours.shape == theirs.shape
    assert_equal_up_to_rounding(ours, theirs, name="ratios", terms=TINY_MODEL_TERMS, scale=float(theirs.max()))
    kept = theirs.flatten() if mode.startswith("sequence") else theirs[expected["completion_mask"].bool()]
    assert (kept == 0).any() == mode.endswith("mask")  # the bounds bind in every mode
    assert mode.endswith("mask") or kept.max() == 3.0 or kept.min() == clip_min
    for name in METRICS:
        assert_equal_up_to_rounding(float(metrics[name]), trl._metrics["train"][name][-1], name=name,
                                    terms=TINY_MODEL_TERMS, scale=3.0)  # fmt: skip
    _assert_trls_loss_and_gradients(module, rollout, trl_loss, trl_model)


def test_the_correction_is_on_by_default_with_an_engine_that_reports_log_probabilities(saved_models):
    """Through a fit: the sampling metrics are logged; RLOO (TRL's has no such correction) refuses its options."""
    backend = EngineCompletions(SamplingSettings(LENGTH), [EOS], 0, logprobs=[])
    module = _module(saved_models["dense"], backend, learning_rate=1e-2, warmup=0)
    backend.logprobs = _engine_logprobs(module, _batch()["prompt_ids"], seed=1)
    trainer = Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, datamodule=PromptDataModule(dataset=_prompts(), batch_size=len(QUESTIONS), seed=0))
    logged = {name: float(trainer.callback_metrics[f"train/{name}"]) for name in METRICS}
    assert 0 < logged["sampling/sampling_logp_difference/mean"] < logged["sampling/sampling_logp_difference/max"]
    with pytest.raises(ValueError, match=r"\['vllm_importance_sampling_mode'\] are GRPOModule's"):
        RLOOModule(preset="tiny-qwen3", tokenizer="lit-memtrain/embedded", reward_funcs=[_tokens_reward],
                   vllm_importance_sampling_mode="token_mask")  # fmt: skip
    with pytest.raises(ValueError, match="vllm_importance_sampling_mode must be one of"):
        GRPOModule(preset="tiny-qwen3", tokenizer="lit-memtrain/embedded", reward_funcs=[_tokens_reward],
                   vllm_importance_sampling_mode="sequence")  # fmt: skip
    with pytest.raises(ValueError, match=r"clip_min \(2.0\) is above vllm_importance_sampling_clip_max \(1.5\)"):
        GRPOModule(preset="tiny-qwen3", tokenizer="lit-memtrain/embedded", reward_funcs=[_tokens_reward],
                   vllm_importance_sampling_clip_min=2.0, vllm_importance_sampling_clip_max=1.5)  # fmt: skip


@pytest.mark.parametrize(("cls", "loss_type"), [(GRPOModule, "chunked"), (GRPOModule, "nll"), (RLOOModule, "chunked")])
def test_a_mixture_of_experts_trains_with_the_router_loss_as_trl_adds_it(saved_models, tokenizer, tmp_path, cls,
                                                                          loss_type):  # fmt: skip
    options = {} if cls is GRPOModule else {"beta": 0.0}
    trl, trl_model = _trl(cls, saved_models["moe"], tokenizer, tmp_path, None, **options)
    expected = trl._generate_and_score_completions([{"prompt": p} for p in _prompts()["prompt"] for _ in range(G)])
    trl_loss = trl._compute_loss(trl_model, expected)
    trl_loss.backward()

    backend = EngineCompletions(SamplingSettings(LENGTH, temperature=0.7), [EOS], 0, logprobs=None)
    module = _module(saved_models["moe"], backend, cls=cls, loss_type=loss_type, **options)
    rollout, rewards, _ = module.generate_rollout(_batch(), "a test batch")
    rollout, _ = module.prepare_rollout(rollout, rewards)
    out = module.slice_loss(rollout, module.loss_normalizer(rollout))
    out.loss.backward()
    assert out.router_aux is not None and out.router_aux > 0
    assert_equal_up_to_rounding(float(out.router_aux), trl._metrics["train"]["aux_loss"][-1], name="aux_loss",
                                terms=TINY_MODEL_TERMS, scale=float(out.router_aux))  # fmt: skip
    assert_equal_up_to_rounding(out.loss, trl_loss, name="loss", terms=TINY_MODEL_TERMS, scale=3.0)
    ours = {n: p.grad for n, p in module.model.named_parameters() if p.grad is not None}
    assert_each_equal_up_to_rounding(ours, {n: p.grad for n, p in trl_model.named_parameters()},
                                     terms=TINY_MODEL_TERMS)  # fmt: skip


@pytest.mark.parametrize("correction", [True, False], ids=["with-correction", "without-correction"])
def test_the_off_policy_mask_compares_with_the_engines_log_probabilities_as_trls(saved_models, tokenizer, tmp_path,
                                                                                 correction):  # fmt: skip
    """With an engine that reports its sampling log-probabilities (vLLM), TRL's off-policy mask
    (``off_policy_mask_threshold``) measures each completion's drift against those (the training-inference mismatch
    and the updates since), whether or not the importance-sampling correction is on. The mask used to compare with
    the trainer's own log-probabilities from generation time (on-policy: the current ones), so with a vLLM engine
    it dropped nothing TRL drops: loss and gradients differed."""
    options = {"off_policy_mask_threshold": 0.05, "vllm_importance_sampling_correction": correction,
               "vllm_importance_sampling_mode": "token_truncate"}
    batch = _batch()
    module = _module(saved_models["dense"], EngineCompletions(SamplingSettings(LENGTH, temperature=0.7), [EOS], 0,
                                                    logprobs=[]), **options)  # fmt: skip
    logprobs = _engine_logprobs(module, batch["prompt_ids"], seed=4)
    module.generation_backend.logprobs = logprobs

    trl, trl_model = _trl(GRPOModule, saved_models["dense"], tokenizer, tmp_path, logprobs, **options)
    trl.use_vllm = True  # all the mask and the correction read of it: generation is the test's
    expected = trl._generate_and_score_completions([{"prompt": p} for p in _prompts()["prompt"] for _ in range(G)])
    trl_loss = trl._compute_loss(trl_model, expected)
    trl_loss.backward()

    rollout, rewards, _ = module.generate_rollout(batch, "a test batch")
    rollout, _ = module.prepare_rollout(rollout, rewards)
    from trl import GRPOTrainer

    with torch.no_grad():  # the engine's drift drops some completions, not all: the mask binds
        logps = module.completion_logps(rollout)
    kept = GRPOTrainer.get_off_policy_mask(rollout.advantages.unsqueeze(1), logps, rollout.sampling_logps,
                                           rollout.completion_mask(), 0.05)  # fmt: skip
    assert 0 < kept.sum() < len(kept)
    _assert_trls_loss_and_gradients(module, rollout, trl_loss, trl_model)
