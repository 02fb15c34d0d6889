"""How GRPOModule reads its data and steps, where TRL 1.16 and the Hugging Face Trainer set the behaviour: an epoch's
last, shorter accumulation window is stepped with its gradients rescaled (the same weights as the plain runs it
amounts to), and dropout (TRL's ``disable_dropout``; sampling without it said once), through real fits."""

from __future__ import annotations

import copy
import logging

import datasets
import lightning
import pytest
import torch
from equivalence import TINY_MODEL_TERMS, assert_each_equal_up_to_rounding
from lightning.pytorch import Callback, Trainer

from lit_memtrain.datamodules.prompts import PromptDataModule
from lit_memtrain.models.generation import GenerationBackend, SamplingSettings
from lit_memtrain.models.lora import LoraSettings
from lit_memtrain.objectives.grpo import GRPOModule
from lit_memtrain.objectives.rollout import Rollout

OVERRIDES = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
             "num_key_value_heads": 1, "head_dim": 16}
PROMPTS = ["What is 1 + 2?", "What is 30 + 4?", "What is 5 + 60?"]


class PromptCompletions(GenerationBackend):
    """Completions that depend on the prompt alone: every run trains on the same ones, whatever its weights."""

    def generate(self, model, prompt_ids, num_generations, device, weights_version):
        return [[10 + (sum(ids) + 7 * g + k) % 50 for k in range(3)]
                for ids in prompt_ids for g in range(num_generations)]


def _token_sum(completion_ids, **kwargs):
    return [float(sum(ids) % 5) for ids in completion_ids]


def _module(accumulation: int, **options) -> GRPOModule:
    torch.manual_seed(0)
    backend = PromptCompletions(SamplingSettings(max_completion_length=3), [2], 0)
    module = GRPOModule(
        preset="tiny-qwen3", config_overrides=OVERRIDES, tokenizer="lit-memtrain/embedded", reward_funcs=[_token_sum],
        num_generations=2, max_completion_length=3, generation_backend=backend, policy_loss="grpo",
        gradient_accumulation_steps=accumulation, max_grad_norm=None, warmup=0, min_lr_ratio=1.0,
        optimizer={"class_path": "torch.optim.SGD", "init_args": {"lr": 0.5}}, **{"steps_per_generation": 1, **options},
    )  # fmt: skip
    module.configure_model()
    return module


class Prompts(Callback):
    def __init__(self) -> None:
        self.batches: list[list[str]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.batches.append(list(batch["prompt"]))


def _fit(module: GRPOModule, prompts: list[str], batch_size: int, max_epochs: int = 1) -> tuple[Trainer, Prompts]:
    record = Prompts()
    trainer = Trainer(max_epochs=max_epochs, accelerator="cpu", logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=[record])
    data = datasets.Dataset.from_list([{"prompt": prompt} for prompt in prompts])
    trainer.fit(module, datamodule=PromptDataModule(dataset=data, batch_size=batch_size, seed=0))
    return trainer, record


def test_an_epochs_last_shorter_window_steps_rescaled_as_the_hugging_face_trainer():
    """3 batches, gradient_accumulation_steps=2: a step on the first two, then one on the third alone at its own
    scale; the same weights as a plain step on the first two prompts together, then one on the third."""
    windowed = _module(accumulation=2)
    trainer, record = _fit(windowed, PROMPTS, batch_size=1)
    assert trainer.global_step == 2 and len(record.batches) == 3

    first_two = [prompt for batch in record.batches[:2] for prompt in batch]
    plain = _module(accumulation=1)
    _fit(plain, first_two, batch_size=2)
    last = _module(accumulation=1)
    last.model.load_state_dict(plain.model.state_dict())
    _fit(last, record.batches[2], batch_size=1)
    assert_each_equal_up_to_rounding(
        dict(windowed.model.named_parameters()), dict(last.model.named_parameters()), terms=TINY_MODEL_TERMS
    )


def test_each_epoch_starts_a_new_window_and_the_schedule_counts_the_short_ones():
    module = _module(accumulation=2)
    trainer, _ = _fit(module, PROMPTS, batch_size=1, max_epochs=2)
    assert trainer.global_step == 4  # windows: batches {0, 1}, {2} of each epoch
    assert module.estimated_optimizer_steps() == 4


@pytest.mark.parametrize("disable_dropout", [False, True])
def test_dropout_is_disabled_as_trl_or_sampling_without_it_is_said_once(caplog, disable_dropout):
    module = _module(accumulation=1, lora=LoraSettings(r=2, alpha=4, dropout=0.3), disable_dropout=disable_dropout)
    seen = set()

    class DropoutInTraining(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            seen.update(m.p for m in pl_module.model.modules() if isinstance(m, torch.nn.Dropout))

    trainer = Trainer(max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False, callbacks=[
        DropoutInTraining()], enable_progress_bar=False, enable_model_summary=False)
    data = datasets.Dataset.from_list([{"prompt": prompt} for prompt in PROMPTS[:2]])
    with caplog.at_level(logging.INFO):
        trainer.fit(module, datamodule=PromptDataModule(dataset=data, batch_size=1, seed=0))
    said = [r.getMessage() for r in caplog.records if "Completions are sampled without dropout" in r.getMessage()]
    if disable_dropout:
        assert seen == {0.0} and said == []
    else:
        assert seen == {0.3} and said == [
            "Completions are sampled without dropout (eval mode) and trained with dropout [0.3]; TRL's transformers "
            "path samples in training mode, with it. disable_dropout=True (TRL's option) trains without dropout too."
        ]


def test_validation_draws_num_generations_eval_completions_per_prompt():
    """TRL's num_generations_eval: training draws num_generations of each prompt, validation this many."""
    drawn = []

    class Recording(PromptCompletions):
        def generate(self, model, prompt_ids, num_generations, device, weights_version):
            drawn.append((model.training, len(prompt_ids), num_generations))
            return super().generate(model, prompt_ids, num_generations, device, weights_version)

    backend = Recording(SamplingSettings(max_completion_length=3), [2], 0)
    module = GRPOModule(preset="tiny-qwen3", config_overrides=OVERRIDES, tokenizer="lit-memtrain/embedded",
                        reward_funcs=[_token_sum], num_generations=2, num_generations_eval=3, max_completion_length=3,
                        generation_backend=backend)  # fmt: skip
    trainer = Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    data = datasets.Dataset.from_list([{"prompt": prompt} for prompt in PROMPTS + ["What is 7 + 8?"]])
    trainer.fit(module, datamodule=PromptDataModule(dataset=data, batch_size=2, val_size=2, seed=0))
    assert drawn == [(True, 2, 2), (False, 2, 3)]
    assert trainer.callback_metrics["val/completions/mean_length"] == 3
    with pytest.raises(ValueError, match="num_generations_eval must be an int >= 1, got 0"):
        GRPOModule(preset="tiny-qwen3", tokenizer="lit-memtrain/embedded", reward_funcs=[_token_sum],
                   num_generations_eval=0)  # fmt: skip


def test_generation_batch_size_is_refused_with_its_translation():
    """TRL sets steps_per_generation from generation_batch_size and per_device_train_batch_size (which has no
    counterpart here): taken as a bare size check, a TRL config of batch 2, generation batch 6 trained one step per
    generation where TRL trains three. Refused, saying what it becomes."""
    with pytest.raises(ValueError, match=r"GRPOModule has no generation_batch_size .*use PromptDataModule\(batch_size="
                       r"generation_batch_size / \(num_generations x ranks\)\) and steps_per_generation="):
        _module(accumulation=1, generation_batch_size=6, steps_per_generation=None)


def test_a_checkpoint_saved_while_generation_batch_size_was_a_parameter_still_loads(tmp_path):
    """Checkpoints of GRPO / RLOO fits written before the refusal hold generation_batch_size=None in their
    hyper-parameters (save_hyperparameters keeps every default); load_from_checkpoint (and so lit-memtrain export)
    builds the module from them, and was refused."""
    module = _module(accumulation=1)
    hparams = {**module.hparams, "generation_batch_size": None}
    checkpoint = {"state_dict": module.state_dict(), "hyper_parameters": hparams,
                  "pytorch-lightning_version": lightning.__version__}  # fmt: skip
    torch.save(checkpoint, tmp_path / "old.ckpt")
    loaded = GRPOModule.load_from_checkpoint(  # objects are given again, as the hyper-parameters name them only
        tmp_path / "old.ckpt", weights_only=False, reward_funcs=[_token_sum],
        generation_backend=PromptCompletions(SamplingSettings(max_completion_length=3), [2], 0),
    )  # fmt: skip
    assert "generation_batch_size" not in loaded.hparams
    assert_each_equal_up_to_rounding(dict(loaded.state_dict()), dict(module.state_dict()), terms=1)


@pytest.mark.parametrize("loss_type", ["chunked", "nll"])
def test_cast_lm_head_to_fp32_scores_with_fp32_logits_in_a_bf16_model(loss_type):
    """TRL's cast_lm_head_to_fp32: a fit generates and trains with the head in fp32; the log-probabilities are those
    of the bf16 decoder's hidden states times the fp32 head, in fp32."""
    backend = PromptCompletions(SamplingSettings(max_completion_length=3), [2], 0)
    module = GRPOModule(preset="tiny-qwen3", config_overrides={**OVERRIDES, "tie_word_embeddings": False},
                        tokenizer="lit-memtrain/embedded", reward_funcs=[_token_sum], num_generations=2,
                        max_completion_length=3, dtype="bfloat16", cast_lm_head_to_fp32=True, loss_type=loss_type,
                        generation_backend=backend if loss_type == "chunked" else "transformers")  # fmt: skip
    trainer = Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False)
    data = datasets.Dataset.from_list([{"prompt": prompt} for prompt in PROMPTS[:2]])
    trainer.fit(module, datamodule=PromptDataModule(dataset=data, batch_size=2, seed=0))
    head = module.model.get_output_embeddings()
    assert head.weight.dtype == torch.float32 and module.model.get_input_embeddings().weight.dtype == torch.bfloat16

    prompt, completion = [5, 6, 7, 8], [40, 41, 2]
    rollout = Rollout.of([prompt], [completion], torch.ones(1, dtype=torch.bool))
    with torch.no_grad():
        ours = module.completion_logps(rollout)[0]
        hidden = module.model.get_decoder()(input_ids=torch.tensor([prompt + completion])).last_hidden_state
        logits = hidden[0, len(prompt) - 1 : -1].float() @ head.weight.T
    expected = logits.log_softmax(-1).gather(-1, torch.tensor(completion)[:, None])[:, 0]
    assert_each_equal_up_to_rounding({"logps": ours}, {"logps": expected}, terms=TINY_MODEL_TERMS)


def test_cast_lm_head_to_fp32_and_sync_ref_model_refuse_what_they_do_not_support():
    for overrides, lora, match in [({}, None, "untied from the input embeddings"),
                                   ({"tie_word_embeddings": False}, LoraSettings(lm_head=True), "LoRA adapter")]:
        module = GRPOModule(preset="tiny-qwen3", config_overrides={**OVERRIDES, **overrides}, lora=lora,
                            tokenizer="lit-memtrain/embedded", reward_funcs=[_token_sum], cast_lm_head_to_fp32=True)
        with pytest.raises(ValueError, match=match):
            module.configure_model()
    module = _module(accumulation=1, beta=0.1, sync_ref_model=True)
    trainer = Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer.strategy.connect(module)
    module.trainer = trainer
    trainer.strategy.parallelize = lambda model: model  # what marks a sharding strategy (FSDP2Strategy has it)
    with pytest.raises(ValueError, match=r"\['sync_ref_model'\] are not supported under FSDP2"):
        module.setup("fit")


def test_sync_ref_model_mixes_the_policy_into_the_reference_as_trls_callback_and_checkpoints_it(tmp_path):
    from trl.trainer.callbacks import SyncRefModelCallback

    module = _module(accumulation=1, beta=0.1, sync_ref_model=True, ref_model_mixup_alpha=0.3, ref_model_sync_steps=2)
    expected = copy.deepcopy(module._reference_model)

    class TRLSync(Callback):  # TRL's on_step_end on the test's copy of the reference, one batch = one step here
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if trainer.global_step % 2 == 0:
                SyncRefModelCallback._sync_target_model(pl_module.model, expected, 0.3)

    trainer = Trainer(max_steps=4, accelerator="cpu", logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=[TRLSync()])
    data = datasets.Dataset.from_list([{"prompt": prompt} for prompt in PROMPTS + ["What is 7 + 8?"]])
    trainer.fit(module, datamodule=PromptDataModule(dataset=data, batch_size=1, seed=0))
    ours = dict(module._reference_model.named_parameters())
    assert_each_equal_up_to_rounding(ours, dict(expected.named_parameters()), terms=TINY_MODEL_TERMS)
    assert not torch.equal(ours["model.embed_tokens.weight"], dict(module.model.named_parameters())[
        "model.embed_tokens.weight"])  # mixed, not copied

    trainer.save_checkpoint(tmp_path / "synced.ckpt")
    resumed = _module(accumulation=1, beta=0.1, sync_ref_model=True, ref_model_mixup_alpha=0.3, ref_model_sync_steps=2)
    resumed.on_load_checkpoint(torch.load(tmp_path / "synced.ckpt", weights_only=False))
    assert_each_equal_up_to_rounding(dict(resumed._reference_model.named_parameters()), ours, terms=1)
    for options, match in [({"beta": 0.0}, "beta != 0"), ({"beta": 0.1, "lora": LoraSettings(r=2)}, "LoRA")]:
        with pytest.raises(ValueError, match=match):
            _module(accumulation=1, sync_ref_model=True, **options)


def test_reward_functions_get_trls_trainer_state_fields_and_log_extra():
    from dataclasses import fields

    from transformers import TrainerState as HFTrainerState

    from lit_memtrain.objectives.reward_functions import TrainerState

    states = []

    def reward(completion_ids, trainer_state, log_extra, **kwargs):
        states.append(trainer_state)
        log_extra("first_token", [ids[0] for ids in completion_ids])
        return [float(sum(ids) % 5) for ids in completion_ids]

    module = _module(accumulation=1)
    module.reward_functions.functions[0] = reward
    trainer, _ = _fit(module, PROMPTS + ["What is 7 + 8?"], batch_size=2, max_epochs=2)
    hf = {f.name: f.type for f in fields(HFTrainerState)}
    assert {f.name for f in fields(TrainerState)} <= set(hf)  # the names TRL's reward functions read
    assert [(s.global_step, s.epoch, s.max_steps, s.num_train_epochs) for s in states] == [
        (0, 0.0, -1, 2), (1, 0.5, -1, 2), (2, 1.0, -1, 2), (3, 1.5, -1, 2)]
    assert states[0].is_world_process_zero and states[0].is_local_process_zero
    assert len(module.completion_extras["first_token"]) == 4  # the last batch's: 2 prompts x 2 completions
