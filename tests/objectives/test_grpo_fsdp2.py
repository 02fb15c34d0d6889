"""GRPOModule under FSDP2Strategy (CPU, gloo, 2 forked processes) against one process on the same prompts: the
completions Hugging Face ``generate`` draws from the sharded model (gathered whole, or layer by layer), the first
step's gradients, the weights after two steps and the logged entropy; with a DAPO loss normalised over both ranks'
tokens, a frozen reference sharded like the policy, a LoRA policy whose reference is its base model, and GSPO with
the high-entropy token mask taken over both ranks' tokens."""

from __future__ import annotations

import os
import random
import time
import traceback
from pathlib import Path

import datasets
import pytest
import torch
import torch.multiprocessing as mp
from equivalence import TINY_MODEL_TERMS, assert_equal_up_to_rounding
from lightning.fabric.plugins.environments.lightning import find_free_network_port
from lightning.pytorch import Callback, Trainer
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from lit_memtrain.datamodules.embedded import make_arithmetic_prompt
from lit_memtrain.datamodules.prompts import PromptDataModule
from lit_memtrain.datamodules.resumable import ResumableSampler
from lit_memtrain.models.generation import TransformersGenerate
from lit_memtrain.models.lora import LoraSettings
from lit_memtrain.objectives.grpo import GRPOModule
from lit_memtrain.strategies import FSDP2Strategy

WORLD, STEPS, PROMPTS_PER_RANK, G, SEED = 2, 2, 2, 2, 42
TIMEOUT_S = 300
VARIANTS = {  # each generation mode, each reference, DAPO's token count over both ranks
    "gathered-dapo-frozen-reference": {"gather_weights_for_generation": True, "policy_loss": "dapo", "beta": 0.1},
    "layer-by-layer-grpo-lora-reference": {"gather_weights_for_generation": False, "policy_loss": "grpo", "beta": 0.1,
                                           "lora": LoraSettings(r=4, alpha=8)},
    # The high-entropy mask's quantile over both ranks' tokens (as one process's), the adaptive entropy controller's
    # reduction over ranks (its bonus 0: entropy_target 0 is never reached), one weight per completion (GSPO).
    "gathered-gspo-top-entropy-adaptive": {"gather_weights_for_generation": True, "policy_loss": "grpo",
                                           "importance_sampling_level": "sequence", "top_entropy_quantile": 0.5,
                                           "use_adaptive_entropy": True, "entropy_coef": 0.0, "entropy_target": 0.0},
}


class Shortened(TransformersGenerate):
    """Greedy completions, generation ``g`` of each prompt cut ``g`` tokens shorter and by up to 2 more depending on
    the prompt: deterministic, different within a group (identical completions would give advantages whose
    gradients cancel) and of different lengths on the two ranks (so that DAPO's token count must be global)."""

    def generate(self, model, prompt_ids, num_generations, device, weights_version):
        completions = super().generate(model, prompt_ids, num_generations, device, weights_version)
        cuts = [i % num_generations + prompt_ids[i // num_generations][5] % 3 for i in range(len(completions))]
        return [c[: max(1, len(c) - cut)] for c, cut in zip(completions, cuts)]


def _by_position(completions, answer, **kwargs):
    """A reward that differs within every group: by the completion's place in it, scaled by the prompt."""
    return [(i % G) * (1 + float(a) / 100) for i, a in enumerate(answer)]


class SeededGRPOModule(GRPOModule):
    completions: list[list[int]]

    def configure_model(self) -> None:
        if self.model is None:
            torch.manual_seed(0)
        super().configure_model()

    def generate_rollout(self, batch, where):
        rollout, rewards, metrics = super().generate_rollout(batch, where)
        self.completions = [*getattr(self, "completions", []), *rollout.completion_ids]
        return rollout, rewards, metrics


def _module(variant: str) -> SeededGRPOModule:
    from lit_memtrain.models.generation import SamplingSettings

    options = dict(VARIANTS[variant])
    gather = options.pop("gather_weights_for_generation")
    backend = Shortened(SamplingSettings(max_completion_length=6, do_sample=False), [2], 0, gather_weights=gather)
    return SeededGRPOModule(
        preset="tiny-qwen3", tokenizer="lit-memtrain/embedded", learning_rate=1e-3, warmup=0, min_lr_ratio=1.0,
        config_overrides={"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "head_dim": 16},
        reward_funcs=[_by_position], num_generations=G, generation_backend=backend, **options,
    )


def _datamodule(batch_size: int) -> PromptDataModule:
    rng = random.Random(0)
    data = datasets.Dataset.from_list([make_arithmetic_prompt(rng) for _ in range(2 * WORLD * PROMPTS_PER_RANK)])
    return PromptDataModule(dataset=data, batch_size=batch_size, seed=SEED, max_prompt_length=None)


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().cpu().clone()


class Record(Callback):
    def __init__(self, path: Path) -> None:
        self.path, self.gradients, self.entropies = path, None, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.entropies.append(float(trainer.callback_metrics["train/entropy"]))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.gradients is None:
            self.gradients = {n: _full(p.grad) for n, p in pl_module.named_parameters() if p.grad is not None}

    def on_train_end(self, trainer, pl_module) -> None:
        weights = {n: _full(p) for n, p in pl_module.named_parameters()}
        torch.save(pl_module.completions, self.path.with_suffix(f".rank{trainer.global_rank}.completions"))
        if trainer.is_global_zero:
            torch.save({"gradients": self.gradients, "weights": weights, "entropies": self.entropies}, self.path)


def _trainer(record: Record, **options) -> Trainer:
    return Trainer(max_steps=STEPS, callbacks=[record], logger=False, enable_progress_bar=False,
                   enable_model_summary=False, enable_checkpointing=False, accelerator="cpu", **options)


def _worker(rank: int, out: Path, port: int, variant: str) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(WORLD),
                       "NODE_RANK": "0", "LOCAL_RANK": str(rank)})
    torch.set_num_threads(1)
    try:
        trainer = _trainer(Record(out / "sharded.pt"), devices=WORLD, strategy=FSDP2Strategy())
        trainer.fit(_module(variant), datamodule=_datamodule(PROMPTS_PER_RANK))
    except Exception:  # noqa: BLE001 - reported by the test
        (out / f"rank{rank}.error").write_text(traceback.format_exc())
        raise


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_sharded_grpo_matches_one_process(tmp_path, variant):
    context = mp.start_processes(_worker, args=(tmp_path, find_free_network_port(), variant), nprocs=WORLD,
                                 join=False, start_method="fork")
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while not context.join(timeout=max(1.0, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the two FSDP2 processes did not finish within {TIMEOUT_S} s")
    except Exception:
        for process in context.processes:
            if process.is_alive():
                process.kill()
        if not list(tmp_path.glob("*.error")):
            raise
    for error in sorted(tmp_path.glob("*.error")):
        pytest.fail(f"the distributed run failed on {error.stem}:\n{error.read_text()}")
    sharded = torch.load(tmp_path / "sharded.pt", weights_only=True)
    rank_completions = [torch.load(tmp_path / f"sharded.rank{r}.completions") for r in range(WORLD)]

    # One process, each step on both ranks' prompts in the order their samplers give them.
    module, datamodule = _module(variant), _datamodule(WORLD * PROMPTS_PER_RANK)
    datamodule.setup("fit")
    train = datamodule.datasets["train"]
    order = [list(ResumableSampler(train, num_replicas=WORLD, rank=r, shuffle=True, seed=SEED)) for r in range(WORLD)]
    per_step = PROMPTS_PER_RANK
    steps = [[i for r in range(WORLD) for i in order[r][s * per_step : (s + 1) * per_step]] for s in range(STEPS)]
    batches = [datamodule.collator()([train[i] for i in indices]) for indices in steps]
    _trainer(Record(tmp_path / "reference.pt"), devices=1).fit(module, DataLoader(batches, batch_size=None))
    expected = torch.load(tmp_path / "reference.pt", weights_only=True)

    per_rank_step = PROMPTS_PER_RANK * G
    for step in range(STEPS):  # the sharded model generated what the whole model generates
        window = slice(step * per_rank_step, (step + 1) * per_rank_step)
        together = [c for r in range(WORLD) for c in rank_completions[r][window]]
        assert together == module.completions[step * WORLD * per_rank_step : (step + 1) * WORLD * per_rank_step]
    assert sharded["gradients"].keys() == expected["gradients"].keys() and expected["gradients"]
    for name, grad in expected["gradients"].items():
        assert grad.abs().max() > 0 or "lora_A" in name, name  # not a vacuous comparison (LoRA A starts at B = 0)
        assert_equal_up_to_rounding(sharded["gradients"][name], grad, name=name, terms=TINY_MODEL_TERMS)
    for name, weight in expected["weights"].items():
        torch.testing.assert_close(sharded["weights"][name], weight, rtol=1e-3, atol=1e-3 * float(weight.abs().max()))
    # The logged entropy is over both ranks' tokens. The random model's entropy is close to log(vocabulary) at every
    # token, so a rank's own mean is off by only ~6e-6 (relative): the tolerance is below that.
    assert len(expected["entropies"]) == STEPS
    assert sharded["entropies"] == pytest.approx(expected["entropies"], rel=1e-6)
