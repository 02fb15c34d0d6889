"""OnlineDPOModule under FSDP2Strategy (CPU, gloo, 2 forked processes) against one process on the same prompts:
the first step's gradients, the weights after two steps and the metrics logged over both ranks' pairs, with the
frozen reference sharded like the policy and completions generated from the sharded model (gathered whole)."""

from __future__ import annotations

import random
from pathlib import Path

import datasets
import torch
from equivalence import TINY_MODEL_TERMS, assert_equal_up_to_rounding
from gloo_ranks import run_on_gloo_ranks, whole_on_host
from lightning.pytorch import Callback, Trainer
from torch.utils.data import DataLoader

from lit_memtrain.datamodules.embedded import make_arithmetic_prompt
from lit_memtrain.datamodules.prompts import PromptDataModule
from lit_memtrain.datamodules.resumable import ResumableSampler
from lit_memtrain.models.generation import SamplingSettings, TransformersGenerate
from lit_memtrain.objectives.online_dpo import OnlineDPOModule
from lit_memtrain.strategies import FSDP2Strategy

WORLD, STEPS, PROMPTS_PER_RANK, SEED = 2, 2, 2, 42
TIMEOUT_S = 300
LOGGED = ("train/loss", "train/rewards/margins", "train/rewards/accuracies", "train/objective/kl",
          "train/objective/scores_margin", "train/logps/chosen", "train/val/contain_eos_token")


class Shortened(TransformersGenerate):
    """Greedy completions, the second of each pair cut shorter (by up to 3 tokens, depending on the prompt): two
    different completions per prompt (a pair of equal ones has no gradient), of different lengths on the ranks."""

    def generate(self, model, prompt_ids, num_generations, device, weights_version):
        completions = super().generate(model, prompt_ids, num_generations, device, weights_version)
        cuts = [i % 2 * (1 + prompt_ids[i // 2][5] % 3) for i in range(len(completions))]
        return [c[: max(1, len(c) - cut)] for c, cut in zip(completions, cuts)]


def _length(completion_ids, **kwargs):
    return [float(len(ids)) for ids in completion_ids]


class SeededOnlineDPOModule(OnlineDPOModule):
    def configure_model(self) -> None:
        if self.model is None:
            torch.manual_seed(0)
        super().configure_model()


def _module() -> SeededOnlineDPOModule:
    backend = Shortened(SamplingSettings(max_completion_length=6, do_sample=False), [2], 0, gather_weights=True)
    return SeededOnlineDPOModule(
        preset="tiny-qwen3", tokenizer="lit-memtrain/embedded", learning_rate=1e-3, warmup=0, min_lr_ratio=1.0,
        config_overrides={"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "head_dim": 16},
        reward_funcs=[_length], beta=0.5, missing_eos_penalty=1.0, max_new_tokens=6, generation_backend=backend,
    )


def _datamodule(batch_size: int) -> PromptDataModule:
    rng = random.Random(0)
    data = datasets.Dataset.from_list([make_arithmetic_prompt(rng) for _ in range(2 * WORLD * PROMPTS_PER_RANK)])
    return PromptDataModule(dataset=data, batch_size=batch_size, seed=SEED, max_prompt_length=None)


class Record(Callback):
    def __init__(self, path: Path) -> None:
        self.path, self.gradients, self.logged = path, None, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.logged.append({name: float(trainer.callback_metrics[name]) for name in LOGGED})

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.gradients is None:
            parameters = pl_module.named_parameters()
            self.gradients = {n: whole_on_host(p.grad) for n, p in parameters if p.grad is not None}

    def on_train_end(self, trainer, pl_module) -> None:
        weights = {n: whole_on_host(p) for n, p in pl_module.named_parameters()}
        if trainer.is_global_zero:
            torch.save({"gradients": self.gradients, "weights": weights, "logged": self.logged}, self.path)


def _trainer(record: Record, **options) -> Trainer:
    return Trainer(max_steps=STEPS, callbacks=[record], logger=False, enable_progress_bar=False,
                   enable_model_summary=False, enable_checkpointing=False, accelerator="cpu", **options)


def _worker(rank: int, out: Path) -> None:
    trainer = _trainer(Record(out / "sharded.pt"), devices=WORLD, strategy=FSDP2Strategy())
    trainer.fit(_module(), datamodule=_datamodule(PROMPTS_PER_RANK))


def test_sharded_online_dpo_matches_one_process(tmp_path):
    run_on_gloo_ranks(_worker, (tmp_path,), world=WORLD, errors=tmp_path, timeout_s=TIMEOUT_S)
    sharded = torch.load(tmp_path / "sharded.pt", weights_only=True)

    # One process, each step on both ranks' prompts in the order their samplers give them.
    datamodule = _datamodule(WORLD * PROMPTS_PER_RANK)
    datamodule.setup("fit")
    train = datamodule.datasets["train"]
    order = [list(ResumableSampler(train, num_replicas=WORLD, rank=r, shuffle=True, seed=SEED)) for r in range(WORLD)]
    per_step = PROMPTS_PER_RANK
    steps = [[i for r in range(WORLD) for i in order[r][s * per_step : (s + 1) * per_step]] for s in range(STEPS)]
    batches = [datamodule.collator()([train[i] for i in indices]) for indices in steps]
    _trainer(Record(tmp_path / "reference.pt"), devices=1).fit(_module(), DataLoader(batches, batch_size=None))
    expected = torch.load(tmp_path / "reference.pt", weights_only=True)

    assert sharded["gradients"].keys() == expected["gradients"].keys() and expected["gradients"]
    for name, grad in expected["gradients"].items():
        assert grad.abs().max() > 0, name  # not a vacuous comparison
        assert_equal_up_to_rounding(sharded["gradients"][name], grad, name=name, terms=TINY_MODEL_TERMS)
    for name, weight in expected["weights"].items():
        torch.testing.assert_close(sharded["weights"][name], weight, rtol=1e-3, atol=1e-3 * float(weight.abs().max()))
    for step, (ours, theirs) in enumerate(zip(sharded["logged"], expected["logged"], strict=True)):
        for name in LOGGED:  # over both ranks' pairs, as one process sees them all
            assert_equal_up_to_rounding(ours[name], theirs[name], name=f"step {step} {name}", terms=TINY_MODEL_TERMS,
                                        scale=max(1.0, abs(theirs[name])))
    assert expected["logged"][0]["train/objective/scores_margin"] > 0  # the pairs differ
    assert expected["logged"][1]["train/rewards/margins"] != 0  # after a step the policy is not its reference
