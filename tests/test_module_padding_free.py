"""The module trains on padding-free batches exactly as on each document alone, and refuses attention
implementations that would let packed documents see each other."""

import pytest
import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from lit_memtrain.datamodules.collate import PaddedCollator
from lit_memtrain.datamodules.padding_free import PaddingFreeCollator
from lit_memtrain.datamodules.sft import SFTDataModule
from lit_memtrain.module import CausalLMModule

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
    total = flat["num_trainable_tokens"]
    per_doc = sum(module.compute_loss(PaddedCollator(0)([doc]), num_items=total) for doc in DOCS)
    per_doc.backward()
    torch.testing.assert_close(loss, per_doc, rtol=1e-5, atol=1e-6)
    for packed, single in zip(packed_grads, (p.grad for p in module.model.parameters())):
        torch.testing.assert_close(packed, single, rtol=1e-4, atol=1e-6)


def test_attention_that_ignores_position_restarts_is_refused():
    def ignores_documents(module, query, key, value, attention_mask, **kwargs):
        return sdpa_attention_forward(module, query, key, value, None, is_causal=True, **kwargs)

    AttentionInterface.register("ignores_documents", ignores_documents)
    module = CausalLMModule(preset="tiny-qwen3", attn_implementation="ignores_documents")
    module.configure_model()
    flat = PaddingFreeCollator(pad_token_id=0)(DOCS)
    with pytest.raises(ValueError, match="not known to keep packed documents apart"):
        module.compute_loss(flat)
    module.compute_loss(PaddedCollator(0)(DOCS))  # padded batches carry a mask: fine


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
