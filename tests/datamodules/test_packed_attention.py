"""A padding-free packed row gives the same logits and loss as running each document alone.

This is the contract ``CausalLMModule`` relies on: transformers keeps packed documents apart for
eager / sdpa / flex_attention by spotting the restarts in ``position_ids``, but only when the model
is called with ``attention_mask=None`` and ``use_cache=False``. The last test shows what an
all-ones attention mask would do instead: documents attend to each other.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from equivalence import TINY_MODEL_TERMS, assert_equal_up_to_rounding
from transformers import AutoModelForCausalLM
from transformers.integrations import flex_attention as flex_integration

from lit_memtrain.datamodules.padding_free import PaddingFreeCollator
from lit_memtrain.models.presets import build_config

ATTENTION = [
    "sdpa",
    "eager",
    "flex_attention",
]
DOCUMENT_LENGTHS = (5, 3, 7)


def compile_without_codegen(monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers always wraps flex_attention (and its block mask) in ``torch.compile``, whose
    C++ code generation takes ~2 min on a 2-core CPU. With the ``eager`` backend, flex_attention
    runs its reference implementation of the same mask: what is under test here is which tokens
    see which, not the speed of the generated kernel."""
    torch._dynamo.reset()
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    monkeypatch.setattr(flex_integration.WrappedFlexAttention, "_instance", None, raising=False)


def build_model(preset: str, attention: str) -> torch.nn.Module:
    torch.manual_seed(0)
    config = build_config(preset)
    model = AutoModelForCausalLM.from_config(
        config, attn_implementation=attention, dtype=torch.float32
    )
    return model.eval()


def documents(vocab_size: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab_size, (length,), generator=generator) for length in DOCUMENT_LENGTHS]


def summed_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The module's loss contract: targets are labels shifted left by one, last one ignored."""
    targets = torch.cat([labels[1:], labels.new_full((1,), -100)])
    return F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum")


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-llama"])
@pytest.mark.parametrize("attention", ATTENTION)
def test_packed_row_equals_documents_run_alone(
    preset: str, attention: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if attention == "flex_attention":
        compile_without_codegen(monkeypatch)
    model = build_model(preset, attention)
    docs = documents(model.config.vocab_size)
    batch = PaddingFreeCollator(pad_to_multiple_of=8)([{"input_ids": doc} for doc in docs])
    assert batch["input_ids"].shape == (1, 16)

    with torch.no_grad():
        packed = model(
            input_ids=batch["input_ids"],
            position_ids=batch["position_ids"],
            attention_mask=None,
            use_cache=False,
        ).logits[0]
        alone = [model(input_ids=doc[None], use_cache=False).logits[0] for doc in docs]

    real = sum(DOCUMENT_LENGTHS)
    assert_equal_up_to_rounding(packed[:real], torch.cat(alone), name="logits", terms=TINY_MODEL_TERMS)

    trainable = int((batch["labels"] != -100).sum())
    packed_loss = summed_loss(packed, batch["labels"][0]) / trainable
    alone_labels = [torch.cat([torch.tensor([-100]), doc[1:]]) for doc in docs]
    alone_sum = sum(summed_loss(logits, labels) for logits, labels in zip(alone, alone_labels))
    alone_loss = alone_sum / sum(length - 1 for length in DOCUMENT_LENGTHS)
    assert trainable == sum(length - 1 for length in DOCUMENT_LENGTHS)
    assert_equal_up_to_rounding(packed_loss, alone_loss, name="loss", terms=TINY_MODEL_TERMS)


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-llama"])
def test_an_all_ones_attention_mask_would_mix_documents(preset: str) -> None:
    model = build_model(preset, "sdpa")
    docs = documents(model.config.vocab_size)
    batch = PaddingFreeCollator()([{"input_ids": doc} for doc in docs])
    with torch.no_grad():
        mixed = model(
            input_ids=batch["input_ids"],
            position_ids=batch["position_ids"],
            attention_mask=torch.ones_like(batch["input_ids"]),
            use_cache=False,
        ).logits[0]
        alone = [model(input_ids=doc[None], use_cache=False).logits[0] for doc in docs]

    first = DOCUMENT_LENGTHS[0]
    assert_equal_up_to_rounding(mixed[:first], alone[0], name="logits", terms=TINY_MODEL_TERMS)  # sees nothing earlier
    assert (mixed[first:] - torch.cat(alone[1:])).abs().max() > 1e-2  # later documents see earlier ones
