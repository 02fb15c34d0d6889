"""DPOModule: one step equals TRL's DPOTrainer (loss and gradients, fp32), padding-free equals padded, the
reference comes from a precomputed pass or the base model under a LoRA adapter, and clear errors."""

from __future__ import annotations

import datasets
import pytest
import torch
from equivalence import TINY_MODEL_TERMS, assert_each_equal_up_to_rounding, assert_equal_up_to_rounding
from lightning.pytorch import Trainer

from lit_memtrain.datamodules.preference import PreferenceDataModule
from lit_memtrain.objectives.dpo import DPOModule
from lit_memtrain.models.lora import LoraSettings
from lit_memtrain.models.presets import build_config

OVERRIDES = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 16}
PAIRS = [
    ("What is 12 + 30?", "42", "41"),
    ("Reverse the word cat.", "tac", "cta"),
    ("Sort the letters of dcba.", "abcd", "abdc"),
    ("What is 7 + 8?", "15", "51"),
]


def _conversational(pairs=PAIRS) -> datasets.Dataset:
    return datasets.Dataset.from_list([
        {"prompt": [{"role": "user", "content": q}], "chosen": [{"role": "assistant", "content": good}],
         "rejected": [{"role": "assistant", "content": bad}]}
        for q, good, bad in pairs
    ])


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory, tokenizer):
    from transformers import AutoModelForCausalLM

    directory = tmp_path_factory.mktemp("dpo-model")
    torch.manual_seed(0)
    config = build_config("tiny-qwen3", {**OVERRIDES, "vocab_size": len(tokenizer)})
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


def _module(saved_model: str | None = None, **kwargs) -> DPOModule:
    source = {"model": saved_model} if saved_model else {"preset": "tiny-qwen3", "config_overrides": OVERRIDES}
    module = DPOModule(**source, tokenizer="lit-memtrain/embedded", attn_implementation="sdpa", **kwargs)
    module.configure_model()
    return module


def _precompute(module: DPOModule, datamodule: PreferenceDataModule) -> None:
    """The reference pass DPOModule runs at fit start, outside a fit (one process)."""
    trainer = Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer.strategy.connect(module)
    module.trainer, trainer.datamodule = trainer, datamodule
    datamodule.setup("fit")
    module.precompute_reference_logps()


def _grads(module: DPOModule) -> dict[str, torch.Tensor]:
    return {n.removeprefix("model."): p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("loss", ["sigmoid", "ipo"])
def test_one_step_equals_trl_dpo_trainer(saved_model, tokenizer, tmp_path, loss):
    from transformers import AutoModelForCausalLM
    from trl import DPOConfig, DPOTrainer

    config = DPOConfig(
        output_dir=str(tmp_path), beta=0.1, loss_type=[loss], precompute_ref_log_probs=True, max_length=None,
        per_device_train_batch_size=4, report_to=[], use_cpu=True, bf16=False, gradient_checkpointing=False,
        dataloader_num_workers=0, precompute_ref_batch_size=2,
    )
    trl_model = AutoModelForCausalLM.from_pretrained(saved_model, attn_implementation="sdpa")
    trl = DPOTrainer(model=trl_model, args=config, train_dataset=_conversational(), processing_class=tokenizer)
    trl_batch = trl.data_collator([trl.train_dataset[i] for i in range(len(PAIRS))])
    trl_model.train()
    trl_loss = trl.compute_loss(trl_model, trl_batch)
    trl_loss.backward()
    trl_grads = {n: p.grad for n, p in trl_model.named_parameters()}

    module = _module(saved_model, beta=0.1, preference_loss=loss)
    datamodule = PreferenceDataModule(dataset=_conversational(), batch_size=4, max_length=512)
    _precompute(module, datamodule)
    train = datamodule.datasets["train"]
    for name in ("ref_chosen_logps", "ref_rejected_logps"):
        theirs = torch.tensor(trl.train_dataset[name])
        assert_equal_up_to_rounding(torch.tensor(train[name]), theirs, name=name, terms=TINY_MODEL_TERMS)
    assert train["chosen_ids"] == trl.train_dataset["chosen_ids"] and train["prompt_ids"] == trl.train_dataset["prompt_ids"]
    batch = datamodule.collator()([train[i] for i in range(len(PAIRS))])
    ours, metrics = module.pair_loss(batch)
    ours.backward()
    assert_equal_up_to_rounding(ours, trl_loss, name="loss", terms=TINY_MODEL_TERMS)
    assert_each_equal_up_to_rounding(_grads(module), trl_grads, terms=TINY_MODEL_TERMS)
    assert metrics["rewards/margins"] == 0  # the first step's policy is the reference


def test_padding_free_equals_padded_and_nll_equals_chunked(saved_model):
    datamodule = PreferenceDataModule(dataset=_conversational(), batch_size=4, max_length=512, pad_to_multiple_of=8)
    datamodule.setup("fit")
    pairs = [datamodule.datasets["train"][i] for i in range(len(PAIRS))]
    reference = {"ref_chosen_logps": -20.0, "ref_rejected_logps": -21.5}
    pairs = [{**pair, **reference} for pair in pairs]
    results = []
    for padding_free, loss_type in [(True, "chunked"), (False, "chunked"), (True, "nll")]:
        module = _module(saved_model, loss_type=loss_type, loss_chunk_size=7)
        datamodule.padding_free = padding_free
        batch = datamodule.collator()(pairs)
        assert ("position_ids" in batch) == padding_free
        loss, metrics = module.pair_loss(batch)
        loss.backward()
        results.append((loss, metrics, _grads(module)))
    (loss, metrics, grads), *others = results
    for other_loss, other_metrics, other_grads in others:
        assert_equal_up_to_rounding(other_loss, loss, name="loss", terms=TINY_MODEL_TERMS)
        summed = max(float(value.abs().max()) for value in metrics.values())  # rewards, margins: log-probs' sums
        for name, value in metrics.items():
            assert_equal_up_to_rounding(other_metrics[name], value, name=name, terms=TINY_MODEL_TERMS, scale=summed)
        assert_each_equal_up_to_rounding(other_grads, grads, terms=TINY_MODEL_TERMS)


def test_lora_reference_is_the_base_model_with_the_adapter_disabled(saved_model):
    datamodule = PreferenceDataModule(dataset=_conversational(), batch_size=4, max_length=512)
    datamodule.setup("fit")
    batch = datamodule.collator()([datamodule.datasets["train"][i] for i in range(len(PAIRS))])
    base = _module(saved_model)
    with torch.no_grad():
        base_logps, _ = base.sequence_logps(batch)
    module = _module(saved_model, lora=LoraSettings(r=4, alpha=8), learning_rate=0.05)
    assert module.reference_mode == "adapter_disabled"
    with torch.no_grad():  # a trained adapter: the policy moves, the reference does not
        for name, param in module.model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.2)
    ref_chosen, ref_rejected = module.batch_reference_logps(batch)
    reference_logps = torch.cat([ref_chosen, ref_rejected])
    assert_equal_up_to_rounding(reference_logps, base_logps, name="log-probs", terms=TINY_MODEL_TERMS)
    policy, _ = module.sequence_logps(batch)
    assert not torch.allclose(policy, base_logps, atol=1e-3)
    loss, metrics = module.pair_loss(batch)
    loss.backward()
    assert all((p.grad is not None) == ("lora_" in n) for n, p in module.model.named_parameters())
    assert metrics["rewards/margins"] != 0


def test_precomputed_reference_is_kept_in_checkpoints_and_not_recomputed(saved_model):
    module = _module(saved_model)
    datamodule = PreferenceDataModule(dataset=_conversational(), batch_size=2, max_length=512, val_size=1)
    _precompute(module, datamodule)
    checkpoint = {"state_dict": {}}
    module.on_save_checkpoint(checkpoint)
    saved = checkpoint["lit_memtrain"]["reference_logps"]
    assert set(saved) == {"train", "validation"} and saved["train"][0].shape == (3,)
    restored = _module(saved_model)
    with torch.no_grad():  # a trained model would give other values: the checkpoint's must be used
        for param in restored.model.parameters():
            param.add_(0.1)
    restored.on_load_checkpoint(checkpoint)
    fresh = PreferenceDataModule(dataset=_conversational(), batch_size=2, max_length=512, val_size=1)
    _precompute(restored, fresh)
    assert fresh.datasets["train"]["ref_chosen_logps"] == datamodule.datasets["train"]["ref_chosen_logps"]


def test_clear_errors_for_bad_settings_and_missing_reference(saved_model):
    with pytest.raises(ValueError, match="no lora is set"):
        DPOModule(preset="tiny-qwen3", reference="adapter_disabled")
    with pytest.raises(ValueError, match="beta must be > 0"):
        DPOModule(preset="tiny-qwen3", beta=0)
    with pytest.raises(ValueError, match="preference_loss must be one of"):
        DPOModule(preset="tiny-qwen3", preference_loss="hinge")
    datamodule = PreferenceDataModule(dataset=_conversational(), batch_size=2, max_length=512)
    datamodule.setup("fit")
    batch = datamodule.collator()([datamodule.datasets["train"][0]])
    with pytest.raises(RuntimeError, match="no reference log-probabilities"):
        _module(saved_model).pair_loss(batch)


def test_validating_a_trained_model_takes_the_reference_from_its_checkpoint_only(saved_model):
    def validate(module: DPOModule) -> dict:
        datamodule = PreferenceDataModule(dataset=_conversational(), batch_size=2, max_length=512, val_size=2)
        trainer = Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False)
        return trainer.validate(module, datamodule=datamodule, verbose=False)[0]

    with pytest.raises(RuntimeError, match="no reference log-probabilities"):
        validate(_module(saved_model))
    module = _module(saved_model)
    module.reference_logps = {"validation": (torch.tensor([-30.0, -31.0]), torch.tensor([-32.0, -33.0]))}
    metrics = validate(module)
    assert metrics["val/rewards/accuracies"] in (0.0, 0.5, 1.0) and "val/rewards/margins" in metrics
    logps = metrics["val/logps/chosen"]  # the reward is a difference of log-probabilities: rounded at their size
    expected = 0.1 * (logps + 30.5)
    assert_equal_up_to_rounding(metrics["val/rewards/chosen"], expected, name="reward", terms=TINY_MODEL_TERMS,
                                scale=0.1 * abs(logps))


def test_under_bf16_mixed_the_precomputed_reference_equals_the_first_step_policy(saved_model):
    """The reference pass runs in the training step's precision: computed in fp32 while the policy runs under
    bf16 autocast, the step-0 rewards (policy = reference) were off by bf16 rounding instead of 0. One pair per
    batch: the reference pass and the step then run the very same row."""
    module = _module(saved_model, learning_rate=0.0)
    datamodule = PreferenceDataModule(dataset=_conversational(), batch_size=1, max_length=512)
    trainer = Trainer(accelerator="cpu", precision="bf16-mixed", max_steps=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, datamodule=datamodule)
    metrics = trainer.callback_metrics
    assert float(metrics["train/rewards/chosen"]) == 0 and float(metrics["train/rewards/rejected"]) == 0


def test_context_parallelism_is_refused_with_a_clear_error_before_any_work():
    from lit_memtrain.strategies import ContextParallelStrategy

    module = DPOModule(preset="tiny-qwen3", config_overrides=OVERRIDES)
    trainer = Trainer(accelerator="cpu", devices=2, strategy=ContextParallelStrategy(2, start_method="fork"), logger=False)
    trainer.strategy.connect(module)
    module.trainer = trainer
    with pytest.raises(ValueError, match=r"DPOModule does not support context parallelism .*Use FSDP2Strategy"):
        module.setup("fit")
    assert module.model is None


def test_adapter_disabled_refuses_a_batch_that_carries_precomputed_reference_columns(saved_model):
    """A dataset with TRL's ref_*_logps columns and a LoRA module (reference 'auto': 'adapter_disabled'): the
    columns used to be taken silently instead of the base model. Refused, naming the fix; with
    reference='precomputed' the columns are the reference."""
    reference = {"ref_chosen_logps": [-20.0, -21.0, -22.0, -23.0], "ref_rejected_logps": [-24.0, -25.0, -26.0, -27.0]}
    data = _conversational()
    for name, values in reference.items():
        data = data.add_column(name, values)
    trainer = Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False)
    module = _module(saved_model, lora=LoraSettings(r=4, alpha=8))
    with pytest.raises(ValueError, match=r"carries precomputed reference log-probabilities \(ref_chosen_logps, "
                                         r"ref_rejected_logps\), but reference='auto' \(with lora, 'auto' is "
                                         r"'adapter_disabled'\).* set reference='precomputed'"):
        trainer.fit(module, datamodule=PreferenceDataModule(dataset=data, batch_size=4, max_length=512))
    datamodule = PreferenceDataModule(dataset=data, batch_size=4, max_length=512)
    datamodule.setup("fit")
    batch = datamodule.collator()([datamodule.datasets["train"][i] for i in range(len(PAIRS))])
    precomputed = _module(saved_model, lora=LoraSettings(r=4, alpha=8), reference="precomputed")
    chosen, rejected = precomputed.batch_reference_logps(batch)
    assert chosen.tolist() == reference["ref_chosen_logps"] and rejected.tolist() == reference["ref_rejected_logps"]



@pytest.mark.parametrize("disable_dropout", [True, False])
def test_dropout_is_disabled_by_default_as_trls_dpo_config_the_lora_adapters_too(saved_model, disable_dropout):
    """TRL's DPOConfig has disable_dropout=True: every nn.Dropout of the policy, a LoRA adapter's included, is set
    to 0 once the adapter wraps the model, so the training forward scores a pair as the model in eval mode does.
    DPOModule used to keep a LoRA adapter's dropout: each step's log-ratios carried dropout noise (a trained adapter
    scored differently in every forward). disable_dropout=False keeps it."""
    datamodule = PreferenceDataModule(dataset=_conversational(), batch_size=4, max_length=512)
    datamodule.setup("fit")
    batch = datamodule.collator()([datamodule.datasets["train"][i] for i in range(len(PAIRS))])
    module = _module(saved_model, lora=LoraSettings(r=4, alpha=8, dropout=0.3), disable_dropout=disable_dropout)
    with torch.no_grad():  # a trained adapter: its dropout shows in the policy's log-probabilities
        for name, param in module.model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.2)
    dropouts = {m.p for m in module.model.modules() if isinstance(m, torch.nn.Dropout) and m.p > 0}
    assert dropouts == (set() if disable_dropout else {0.3})
    torch.manual_seed(0)
    module.train()
    with torch.no_grad():
        trained = module.pair_loss(batch)[1]["logps/chosen"]
        module.eval()
        evaluated = module.pair_loss(batch)[1]["logps/chosen"]
    if disable_dropout:
        assert_equal_up_to_rounding(trained, evaluated, name="log-probs", terms=TINY_MODEL_TERMS, scale=abs(evaluated))
    else:
        assert abs(float(trained - evaluated)) > 1e-2
