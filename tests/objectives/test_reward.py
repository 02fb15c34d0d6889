"""RewardModule: one step equals TRL's RewardTrainer (TRL's formats, margin and centering; loss and gradients,
fp32), padding-free equals padded and the model's own forward (pad == eos included), pad_to_multiple_of, LoRA with
the score head trained and merged on export, the data TRL's RewardTrainer trains on, gradient accumulation as TRL's,
and clear errors."""

from __future__ import annotations

import logging

import datasets
import pytest
import torch
from equivalence import TINY_MODEL_TERMS, assert_each_equal_up_to_rounding, assert_equal_up_to_rounding
from lightning.pytorch import Callback, Trainer
from transformers import AutoModelForSequenceClassification

from lit_memtrain.datamodules.preference import PreferenceDataModule
from lit_memtrain.datamodules.resumable import ResumableSampler
from lit_memtrain.models.lora import LoraSettings
from lit_memtrain.models.presets import build_config
from lit_memtrain.objectives.reward import RewardModule

OVERRIDES = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 16}
PAIRS = [
    ("What is 12 + 30?", "42", "41"),
    ("Reverse the word cat.", "tac", "cta"),
    ("Sort the letters of dcba.", "abcd", "abdc"),
    ("What is 7 + 8?", "15", "51"),
]
MARGINS = [0.5, 0.0, 1.0, 0.25]


def _pairs(form: str, margin: bool = False) -> datasets.Dataset:
    """The pairs in one of TRL's preference formats: explicit or implicit prompt, strings or chat messages."""
    rows = []
    for (question, good, bad), value in zip(PAIRS, MARGINS):
        if form == "conversational":
            row = {"prompt": [{"role": "user", "content": question}],
                   "chosen": [{"role": "assistant", "content": good}],
                   "rejected": [{"role": "assistant", "content": bad}]}
        elif form == "standard":
            row = {"prompt": f"Q: {question} A:", "chosen": f" {good}", "rejected": f" {bad}"}
        elif form == "implicit_standard":
            row = {"chosen": f"Q: {question} A: {good}", "rejected": f"Q: {question} A: {bad}"}
        else:
            user = {"role": "user", "content": question}
            row = {"chosen": [user, {"role": "assistant", "content": good}],
                   "rejected": [user, {"role": "assistant", "content": bad}]}
        rows.append({**row, "margin": value} if margin else row)
    return datasets.Dataset.from_list(rows)


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory, tokenizer):
    directory = tmp_path_factory.mktemp("reward-model")
    torch.manual_seed(0)
    config = build_config("tiny-qwen3", {**OVERRIDES, "num_labels": 1, "pad_token_id": tokenizer.pad_token_id})
    AutoModelForSequenceClassification.from_config(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="module")
def eos_padded_tokenizer(tmp_path_factory, tokenizer):
    """The embedded tokenizer saved without a pad token: loading it pads with its eos token (TRL's fallback)."""
    directory = tmp_path_factory.mktemp("no-pad-tokenizer")
    tokenizer.save_pretrained(directory)
    import json

    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("pad_token", None)
    config_path.write_text(json.dumps(config))
    return str(directory)


def _module(saved_model: str | None = None, tokenizer: str = "lit-memtrain/embedded", **kwargs) -> RewardModule:
    source = {"model": saved_model} if saved_model else {"preset": "tiny-qwen3", "config_overrides": OVERRIDES}
    torch.manual_seed(0)
    module = RewardModule(**{"attn_implementation": "sdpa", **source, "tokenizer": tokenizer, **kwargs})
    module.configure_model()
    return module


def _grads(module: RewardModule) -> dict[str, torch.Tensor]:
    return {n.removeprefix("model."): p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def _batch(data: datasets.Dataset, tokenizer: str = "lit-memtrain/embedded", **options) -> dict:
    datamodule = PreferenceDataModule(tokenizer=tokenizer, dataset=data, batch_size=len(data), long_pairs="drop",
                                      **options)
    datamodule.setup("fit")
    train = datamodule.datasets["train"]
    return datamodule.collator()([train[i] for i in range(len(train))])


@pytest.mark.parametrize(("form", "margin", "center"), [
    ("conversational", False, None), ("standard", True, 0.01), ("implicit_standard", False, 0.01),
    ("implicit_conversational", True, None),
])  # fmt: skip
def test_one_step_equals_trl_reward_trainer(saved_model, tokenizer, tmp_path, form, margin, center):
    from trl import RewardConfig, RewardTrainer

    data = _pairs(form, margin)
    config = RewardConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=len(PAIRS), report_to=[], use_cpu=True, bf16=False,
        dataloader_num_workers=0, center_rewards_coefficient=center,
    )
    trl_model = AutoModelForSequenceClassification.from_pretrained(saved_model, attn_implementation="sdpa")
    trl = RewardTrainer(model=trl_model, args=config, train_dataset=data, processing_class=tokenizer)
    trl_batch = trl.data_collator([trl.train_dataset[i] for i in range(len(PAIRS))])
    trl_model.train()
    trl_loss = trl.compute_loss(trl_model, trl_batch)
    trl_loss.backward()
    trl_grads = {n: p.grad for n, p in trl_model.named_parameters()}

    module = _module(saved_model, center_rewards_coefficient=center)
    datamodule = PreferenceDataModule(dataset=data, batch_size=len(PAIRS), long_pairs="drop")
    datamodule.setup("fit")
    train = datamodule.datasets["train"]
    for side in ("chosen", "rejected"):  # TRL's tokens, sequence by sequence
        ours = [prompt + completion for prompt, completion in zip(train["prompt_ids"], train[f"{side}_ids"])]
        assert ours == trl.train_dataset[f"{side}_ids"]
    batch = datamodule.collator()([train[i] for i in range(len(PAIRS))])
    assert "position_ids" in batch and ("margin" in batch) == margin  # one padding-free row
    loss, chosen, rejected = module.pair_loss(batch)
    loss.backward()
    assert_equal_up_to_rounding(loss, trl_loss, name="loss", terms=TINY_MODEL_TERMS)
    assert_each_equal_up_to_rounding(_grads(module), trl_grads, terms=TINY_MODEL_TERMS)
    with torch.no_grad():
        trl_rewards = trl_model(**{k: v for k, v in trl_batch.items() if k != "margin"}).logits[:, 0]
    assert_equal_up_to_rounding(torch.cat([chosen, rejected]), trl_rewards, name="rewards", terms=TINY_MODEL_TERMS)


@pytest.mark.parametrize("pad_is_eos", [False, True], ids=["pad-differs-from-eos", "pad-is-eos"])
def test_padding_free_equals_padded_and_the_models_own_forward(pad_is_eos, eos_padded_tokenizer):
    tokenizer = eos_padded_tokenizer if pad_is_eos else "lit-memtrain/embedded"
    data = _pairs("conversational", margin=True)
    results = []
    for padding_free, multiple in [(True, None), (True, 64), (False, None), (False, 8)]:
        module = _module(tokenizer=tokenizer)
        batch = _batch(data, tokenizer, padding_free=padding_free, pad_to_multiple_of=multiple)
        assert ("position_ids" in batch) == padding_free
        if multiple:
            assert batch["input_ids"].shape[-1] % multiple == 0
        loss, chosen, rejected = module.pair_loss(batch)
        loss.backward()
        results.append((loss, torch.cat([chosen, rejected]), _grads(module)))
        if not padding_free:  # transformers' own reading of the padded rows: the position an export reads
            with torch.no_grad():
                own = module.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, 0]
            assert_equal_up_to_rounding(torch.cat([chosen, rejected]), own, name="rewards", terms=TINY_MODEL_TERMS)
    assert (module.pad_token_id == module.model.config.eos_token_id) == pad_is_eos
    (loss, rewards, grads), *others = results
    for other_loss, other_rewards, other_grads in others:
        assert_equal_up_to_rounding(other_loss, loss, name="loss", terms=TINY_MODEL_TERMS)
        assert_equal_up_to_rounding(other_rewards, rewards, name="rewards", terms=TINY_MODEL_TERMS)
        assert_each_equal_up_to_rounding(other_grads, grads, terms=TINY_MODEL_TERMS)


def _fit(module: RewardModule, datamodule: PreferenceDataModule, steps: int) -> Trainer:
    trainer = Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(module, datamodule=datamodule)
    return trainer


def test_lora_trains_the_adapter_and_the_whole_score_head_and_exports_them_merged(tmp_path):
    module = _module(lora=LoraSettings(r=4, alpha=8), learning_rate=1e-2, warmup=0)
    trainable = {n for n, p in module.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n or "score.modules_to_save" in n for n in trainable)
    assert any("score.modules_to_save" in n for n in trainable)
    before = {n: p.detach().clone() for n, p in module.model.named_parameters()}
    datamodule = PreferenceDataModule(dataset=_pairs("conversational"), batch_size=2, long_pairs="drop")
    _fit(module, datamodule, steps=4)
    changed = {n for n, p in module.model.named_parameters() if not torch.equal(p, before[n])}
    assert changed == trainable  # every adapter and score weight moved, nothing else

    path = module.export(tmp_path / "export")
    exported = AutoModelForSequenceClassification.from_pretrained(path).eval()
    batch = _batch(_pairs("conversational"), padding_free=False)
    module.model.eval()
    with torch.no_grad():
        theirs = exported(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, 0]
        ours = module.sequence_rewards(batch)
    assert_equal_up_to_rounding(theirs, ours, name="rewards", terms=TINY_MODEL_TERMS)
    assert exported.config.pad_token_id == module.pad_token_id and exported.config.num_labels == 1


def test_pairs_over_max_length_are_dropped_as_trl_drops_them_and_truncating_data_is_refused(tokenizer):
    long_answer = " ".join(["word"] * 40)
    data = datasets.Dataset.from_list([
        {"prompt": "Q: say it.", "chosen": " ok", "rejected": long_answer, "margin": 1.0},
        {"prompt": "Q: again.", "chosen": " yes", "rejected": " no", "margin": 0.5},
    ])
    dropping = PreferenceDataModule(dataset=data, max_length=16, long_pairs="drop", batch_size=2)
    dropping.setup("fit")
    assert len(dropping.datasets["train"]) == 1 and dropping.token_counts["train"].dropped_examples == 1
    batch = dropping.collator()([dropping.datasets["train"][0]])
    assert batch["margin"].tolist() == [0.5]
    truncating = PreferenceDataModule(dataset=data, max_length=16, batch_size=2)
    truncating.setup("fit")
    assert len(truncating.datasets["train"]) == 2  # DPO's rule: the long sequence is cut, its pair kept
    with pytest.raises(ValueError, match=r"long_pairs='truncate'.*Set long_pairs='drop'"):
        _fit(_module(), truncating, steps=1)


def test_a_tokenizer_without_pad_token_pads_with_eos_and_the_log_says_where_rewards_are_read(
    eos_padded_tokenizer, caplog
):
    with pytest.warns(UserWarning, match=r"has no pad token; using its eos token '<\|im_end\|>'"):
        module = _module(tokenizer=eos_padded_tokenizer)
    datamodule = PreferenceDataModule(tokenizer=eos_padded_tokenizer, dataset=_pairs("standard"), batch_size=2,
                                      long_pairs="drop")
    with caplog.at_level(logging.INFO):
        _fit(module, datamodule, steps=1)
    assert "last token that is not the pad token '<|im_end|>'" in caplog.text
    assert "the pad token is the eos token, so a trailing eos counts as padding" in caplog.text


def test_a_causal_lm_loads_under_a_new_score_head_in_the_dtype_and_attention_asked(tmp_path, tokenizer):
    """TRL's path from an SFT model to a reward model: the decoder of a causal LM checkpoint under a fresh one-output
    score head, here in bf16 with eager attention; the rewards are read where the model's own forward reads them."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = build_config("tiny-qwen3", {**OVERRIDES, "pad_token_id": tokenizer.pad_token_id})
    causal_lm = AutoModelForCausalLM.from_config(config)
    causal_lm.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    module = _module(str(tmp_path), dtype="bfloat16", attn_implementation="eager")
    model = module.model
    assert type(model).__name__ == "Qwen3ForSequenceClassification" and model.config.num_labels == 1
    assert model.config._attn_implementation == "eager"
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    decoder = causal_lm.model.state_dict()
    for name, weight in model.model.state_dict().items():  # the decoder's weights, cast
        torch.testing.assert_close(weight, decoder[name].to(torch.bfloat16), rtol=0, atol=0)
    assert model.score.weight.shape == (1, OVERRIDES["hidden_size"])
    module._check_reward_reading()  # ours equal the model's own forward in bf16 too
    loss, _, _ = module.pair_loss(_batch(_pairs("standard")))
    loss.backward()
    assert torch.isfinite(loss) and model.score.weight.grad is not None


def test_bad_settings_are_refused_with_what_to_do(eos_padded_tokenizer):
    with pytest.raises(ValueError, match=r"center_rewards_coefficient must be >= 0"):
        RewardModule(preset="tiny-qwen3", center_rewards_coefficient=-0.1)
    with pytest.raises(ValueError, match=r"lora.lm_head adapts an LM head, which a reward model does not have"):
        RewardModule(preset="tiny-qwen3", lora=LoraSettings(lm_head=True))
    module = RewardModule(preset="tiny-qwen3", config_overrides=OVERRIDES)  # no tokenizer, and no pad id in the preset
    with pytest.raises(ValueError, match=r"has no pad token id.*Give the module a tokenizer"):
        module.configure_model()
    mismatched = PreferenceDataModule(tokenizer=eos_padded_tokenizer, dataset=_pairs("standard"), batch_size=2,
                                      long_pairs="drop")
    with pytest.raises(ValueError, match=r"padded with token id 2 but the reward model reads past pad token id 0"):
        _fit(_module(), mismatched, steps=1)


class _StepGradients(Callback):
    def __init__(self) -> None:
        self.steps: list[dict[str, torch.Tensor]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.steps.append(_grads(pl_module))


def test_accumulated_steps_train_on_the_mean_of_their_micro_batch_means_the_short_last_one_included():
    data = _pairs("standard", margin=True).select(range(3))  # batches of 1 pair, 2 per step: the second step has 1
    sgd = {"class_path": "torch.optim.SGD", "init_args": {"lr": 0.0}}  # the weights stay: every step's gradient
    module = _module(optimizer=sgd, warmup=0, center_rewards_coefficient=0.01)
    datamodule = PreferenceDataModule(dataset=data, batch_size=1, long_pairs="drop")
    record = _StepGradients()
    trainer = Trainer(max_steps=2, accumulate_grad_batches=2, accelerator="cpu", logger=False, callbacks=[record],
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, datamodule=datamodule)
    train = datamodule.datasets["train"]
    order = list(ResumableSampler(train, shuffle=True, seed=datamodule.seed))
    module.zero_grad()
    loss = sum(module.pair_loss(datamodule.collator()([train[i]]))[0] for i in order[:2]) / 2
    loss.backward()
    first = _grads(module)
    module.zero_grad()
    module.pair_loss(datamodule.collator()([train[order[2]]]))[0].backward()
    for step, expected in zip(record.steps, (first, _grads(module)), strict=True):
        for name, grad in expected.items():
            assert_equal_up_to_rounding(step[name], grad, name=name, terms=TINY_MODEL_TERMS)


def test_packed_documents_are_probed_apart_on_the_decoders_hidden_states():
    """An attention implementation the project's tests do not prove is probed once on a padding-free batch; a
    reward model has no per-token logits, so the probe compares its decoder's last hidden states."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register("leaky_for_test", sdpa_attention_forward)  # no mask of its own: one causal row
    AttentionInterface.register("isolating_for_test", sdpa_attention_forward)
    AttentionMaskInterface.register("isolating_for_test", sdpa_mask)  # sdpa's: a block per packed document
    batch = _batch(_pairs("standard"))
    module = _module()
    module.model.set_attn_implementation("leaky_for_test")
    with pytest.raises(ValueError, match=r"'leaky_for_test' lets packed documents attend to each other"):
        module.pair_loss(batch)
    module.model.set_attn_implementation("isolating_for_test")
    module.pair_loss(batch)[0].backward()
    assert module.setup_probes.isolating_attention == "isolating_for_test"


@pytest.mark.parametrize("disable_dropout", [True, False])
def test_disable_dropout_zeroes_every_dropout_the_lora_adapters_too_as_trls_reward_trainer(disable_dropout):
    """TRL's RewardTrainer disables dropout after PEFT wraps the model: the adapter's dropout is zeroed too, so a
    training-mode forward is deterministic."""
    seen = {}

    class TrainModeForwards(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            with torch.no_grad():
                seen["forwards"] = [pl_module.sequence_rewards(batch) for _ in range(2)]
            seen["training"] = pl_module.training
            seen["p"] = {m.p for m in pl_module.model.modules() if isinstance(m, torch.nn.Dropout)}

    module = _module(lora=LoraSettings(r=4, alpha=8, dropout=0.5), disable_dropout=disable_dropout)
    with torch.no_grad():  # B starts at 0, which hides what the dropout before A does
        for name, parameter in module.model.named_parameters():
            if "lora_B" in name:
                parameter.normal_()
    datamodule = PreferenceDataModule(dataset=_pairs("conversational"), batch_size=2, long_pairs="drop")
    trainer = Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False, callbacks=[
        TrainModeForwards()], enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(module, datamodule=datamodule)
    first, second = seen["forwards"]
    assert seen["training"]
    if disable_dropout:
        assert seen["p"] == {0.0} and torch.equal(first, second)
    else:
        assert 0.5 in seen["p"] and not torch.equal(first, second)
