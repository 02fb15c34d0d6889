"""The module trains on padding-free batches exactly as on each document alone, probes attention
implementations not proven here, and refuses those that would let packed documents see each other."""

import pytest
import torch
from equivalence import TINY_MODEL_TERMS, assert_equal_up_to_rounding
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from lit_memtrain.datamodules.collate import PaddedCollator
from lit_memtrain.datamodules.padding_free import PaddingFreeCollator
from lit_memtrain.datamodules.sft import SFTDataModule
from lit_memtrain.objectives.causal_lm import CausalLMModule

DOCS = [
    {"input_ids": [5, 6, 7, 8, 9, 10], "labels": [-100, -100, 7, 8, 9, 10]},
    {"input_ids": [11, 12, 13], "labels": [11, 12, 13]},
    {"input_ids": [20, 21, 22, 23], "labels": [-100, 21, 22, 23]},
]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("loss_type", ["chunked", "nll"])
def test_padding_free_loss_and_gradients_equal_per_document_runs(attn, loss_type):
    torch.manual_seed(0)
    module = CausalLMModule(preset="tiny-qwen3", attn_implementation=attn, loss_type=loss_type)
    module.configure_model()
    flat = PaddingFreeCollator(pad_token_id=0, pad_to_multiple_of=8)(DOCS)
    loss = module.compute_loss(flat)
    loss.backward()
    packed_grads = [p.grad.clone() for p in module.model.parameters()]
    module.zero_grad()
    total = module.count_trainable_targets(flat)
    per_doc = sum(module.compute_loss(PaddedCollator(0)([doc]), num_items=total) for doc in DOCS)
    per_doc.backward()
    assert_equal_up_to_rounding(loss, per_doc, name="loss", terms=TINY_MODEL_TERMS)
    for packed, (name, p) in zip(packed_grads, module.model.named_parameters()):
        assert_equal_up_to_rounding(packed, p.grad, name=name, terms=TINY_MODEL_TERMS)


def _ignores_documents(module, query, key, value, attention_mask, **kwargs):
    return sdpa_attention_forward(module, query, key, value, None, is_causal=True, **kwargs)


def _keeps_documents_apart(module, query, key, value, attention_mask, **kwargs):
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register("ignores_documents", _ignores_documents)
AttentionInterface.register("keeps_documents_apart", _keeps_documents_apart)
AttentionMaskInterface.register("keeps_documents_apart", sdpa_mask)


def test_attention_that_ignores_position_restarts_is_refused_by_the_setup_probe():
    module = CausalLMModule(preset="tiny-qwen3", attn_implementation="ignores_documents")
    module.configure_model()
    module.compute_loss(PaddedCollator(0)(DOCS))  # padded batches carry a mask: fine
    flat = PaddingFreeCollator(pad_token_id=0)(DOCS)
    with pytest.raises(ValueError, match="'ignores_documents' lets packed documents attend to each other"):
        module.compute_loss(flat)


def test_a_new_implementation_that_keeps_documents_apart_is_probed_once_and_trains(tmp_path, monkeypatch):
    from lightning.pytorch import Trainer

    import lit_memtrain.objectives.probes as probes_file

    probed = []
    probe = probes_file.probe_document_isolation
    monkeypatch.setattr(probes_file, "probe_document_isolation", lambda *args: probed.append(args[2]) or probe(*args))
    module = CausalLMModule(preset="tiny-qwen3", tokenizer="lit-memtrain/embedded", attn_implementation="keeps_documents_apart")
    trainer = Trainer(max_steps=3, logger=False, enable_progress_bar=False, enable_checkpointing=False, default_root_dir=tmp_path)
    trainer.fit(module, datamodule=SFTDataModule(max_length=40, packing=True, batch_size=2))
    assert probed == ["keeps_documents_apart"]
    assert module.last_train_loss is not None


def test_a_packed_fit_with_a_leaking_implementation_stops_before_training(tmp_path):
    from lightning.pytorch import Trainer

    module = CausalLMModule(preset="tiny-qwen3", tokenizer="lit-memtrain/embedded", attn_implementation="ignores_documents")
    trainer = Trainer(max_steps=3, logger=False, enable_progress_bar=False, enable_checkpointing=False, default_root_dir=tmp_path)
    with pytest.raises(ValueError, match="lets packed documents attend to each other"):
        trainer.fit(module, datamodule=SFTDataModule(max_length=40, packing=True, batch_size=2))
    assert trainer.global_step == 0 and module.first_train_loss is None


HYBRID = {"model_type": "bamba", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "mamba_n_heads": 4, "mamba_d_head": 16, "mamba_d_state": 8,
          "attn_layer_indices": [1], "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}  # fmt: skip


@pytest.mark.parametrize("attn", ["sdpa", "eager", "sdpa_by_document"])
def test_a_hybrid_model_whose_mamba_layers_carry_state_across_documents_is_refused(attn):
    """Bamba's attention keeps packed documents apart under sdpa, eager and sdpa_by_document, but its Mamba layer
    carries the first document's state into the second: these implementations skipped the probe and such packed
    rows trained on logits 0.1 (relative) away from each document's own, silently."""
    torch.manual_seed(0)
    module = CausalLMModule(config=HYBRID, attn_implementation=attn)
    module.configure_model()
    module.compute_loss(PaddedCollator(0)(DOCS))  # padded rows: one document each, nothing to carry
    with pytest.raises(ValueError, match=f"'{attn}' lets packed documents .* BambaForCausalLM: .*carry one document's state"):
        module.compute_loss(PaddingFreeCollator(pad_token_id=0)(DOCS))


LFM2 = {"model_type": "lfm2", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "layer_types": ["conv", "full_attention"], "pad_token_id": 0,
        "bos_token_id": 1, "eos_token_id": 2}  # fmt: skip


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_short_convolution_that_leaks_weakly_into_the_next_document_is_refused(dtype):
    """A tiny random LFM2: its short convolutions carry a document's last tokens into the next one's first, which
    moved the packed logits by 8.5e-5 (relative, whole document) in fp32, under the probe's fixed 1e-4, and below
    bf16's rounding of the comparison with the document alone; padding-free rows trained on them, silently."""
    torch.manual_seed(0)
    module = CausalLMModule(config=LFM2, attn_implementation="sdpa_by_document", dtype=dtype)
    module.configure_model()
    module.compute_loss(PaddedCollator(0)(DOCS))  # padded rows: one document each, nothing to carry
    with pytest.raises(ValueError, match="'sdpa_by_document' lets packed documents .* Lfm2ForCausalLM: .*carry one"):
        module.compute_loss(PaddingFreeCollator(pad_token_id=0)(DOCS))


@pytest.mark.parametrize("attn", ["sdpa", "eager", "sdpa_by_document"])
def test_implementations_that_keep_documents_apart_pass_the_probe_once(attn, monkeypatch):
    import lit_memtrain.objectives.probes as probes_file

    probed = []
    probe = probes_file.probe_document_isolation
    monkeypatch.setattr(probes_file, "probe_document_isolation", lambda *args: probed.append(args[2]) or probe(*args))
    module = CausalLMModule(preset="tiny-qwen3", attn_implementation=attn)
    module.configure_model()
    for _ in range(2):
        module.compute_loss(PaddingFreeCollator(pad_token_id=0)(DOCS))
    assert probed == [attn]


def test_packed_rows_under_an_attention_mask_are_refused():
    """A collator that adds an attention mask (all ones) to packed rows: transformers then ignores the restarts of
    position_ids and the documents attend to each other (the loss moved from 6.2691 to 6.2733, silently)."""
    torch.manual_seed(0)
    module = CausalLMModule(preset="tiny-qwen3", attn_implementation="sdpa")
    module.configure_model()
    flat = PaddingFreeCollator(pad_token_id=0)(DOCS)
    masked = {**flat, "attention_mask": torch.ones_like(flat["input_ids"])}
    with pytest.raises(ValueError, match="in row 0 the position ids restart at token 6 .from 5 to 0."):
        module.compute_loss(masked)
    padded = PaddedCollator(0)(DOCS)  # one document a row, right-padded: positions continue under the mask
    positions = torch.arange(padded["input_ids"].shape[1]).expand_as(padded["input_ids"])
    fresh = CausalLMModule(preset="tiny-qwen3", attn_implementation="sdpa")
    fresh.configure_model()
    fresh.compute_loss({**padded, "position_ids": positions})


@pytest.mark.parametrize("strategy", ["bfd", "bfd_split", "wrapped"])
def test_datamodule_packs_after_truncation_and_batches_padding_free(strategy):
    plain = SFTDataModule(max_length=40)
    plain.setup("fit")
    packed = SFTDataModule(max_length=40, packing=True, packing_strategy=strategy, batch_size=2)
    packed.setup("fit")
    tokens = sum(len(ids) for ids in plain.train_dataset["input_ids"])
    assert sum(len(ids) for ids in packed.train_dataset["input_ids"]) == tokens  # examples are < 40 tokens
    assert max(len(ids) for ids in packed.train_dataset["input_ids"]) <= 40
    batch = next(iter(packed.train_dataloader()))
    assert batch["input_ids"].shape[0] == 1 and "attention_mask" not in batch
    assert batch["position_ids"][0, 0] == 0


def test_packing_requires_padding_free():
    with pytest.raises(ValueError, match="packing=True needs padding-free batches"):
        SFTDataModule(packing=True, padding_free=False)
    with pytest.raises(ValueError, match="packing_strategy must be one of"):
        SFTDataModule(packing=True, packing_strategy="greedy")
