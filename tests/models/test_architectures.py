"""The chunked loss equals the model's own logits + cross-entropy (loss and gradients, fp32) on every
architecture users bring, whatever the model does to its logits after the LM head; what it cannot reproduce
is refused at setup, naming loss_type="nll"."""

from __future__ import annotations

import pytest
import torch
from equivalence import TINY_MODEL_TERMS, assert_equal_up_to_rounding
from transformers import Qwen3ForCausalLM

from lit_memtrain.objectives.causal_lm import CausalLMModule
from lit_memtrain.models.presets import build_config
from lit_memtrain.objectives.probes import LogitTransform, probe_logit_transform

TINY = {
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 128,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
# Each architecture with what it does after its LM head set so that it changes the loss; attention eager
# where the model supports nothing else (Gemma 2's attention softcap, GPT-OSS's sinks).
ARCHITECTURES = {
    "llama": ({}, "sdpa"),
    "qwen2": ({}, "sdpa"),
    "qwen3": ({}, "sdpa"),
    "qwen3_moe": ({"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16}, "sdpa"),
    "mistral": ({}, "sdpa"),
    "gemma2": ({"final_logit_softcapping": 0.5}, "eager"),
    "gemma3_text": ({"final_logit_softcapping": 0.5}, "sdpa"),
    "granite": ({"logits_scaling": 4.0}, "sdpa"),
    "cohere": ({"logit_scale": 3.0}, "sdpa"),
    "falcon_h1": ({"lm_head_multiplier": 4.0, "mamba_d_ssm": 32, "mamba_n_heads": 4, "mamba_d_head": 8}, "sdpa"),
    "phi3": ({}, "sdpa"),
    "olmo2": ({}, "sdpa"),
    "gpt_oss": ({"num_local_experts": 4, "num_experts_per_tok": 2}, "eager"),
}


def _module(model_type: str, loss_type: str, **config) -> CausalLMModule:
    extra, attention = ARCHITECTURES[model_type]
    torch.manual_seed(0)
    module = CausalLMModule(
        config={"model_type": model_type, **TINY, **extra, **config},
        attn_implementation=attention,
        loss_type=loss_type,
        loss_chunk_size=7,
    )
    module.configure_model()
    return module


def _batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(3, TINY["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[:, :3] = -100
    return {"input_ids": ids, "labels": labels}


@pytest.mark.parametrize("model_type", sorted(ARCHITECTURES))
def test_chunked_loss_and_gradients_equal_the_models_own_logits(model_type):
    chunked, plain = _module(model_type, "chunked"), _module(model_type, "nll")
    batch = _batch()
    loss_chunked, loss_plain = chunked.compute_loss(batch), plain.compute_loss(batch)
    loss_chunked.backward()
    loss_plain.backward()
    assert_equal_up_to_rounding(loss_chunked, loss_plain, name="loss", terms=TINY_MODEL_TERMS)
    expected = dict(plain.model.named_parameters())
    for name, param in chunked.model.named_parameters():
        if expected[name].grad is None:
            assert param.grad is None, name
            continue
        assert_equal_up_to_rounding(param.grad, expected[name].grad, name=name, terms=TINY_MODEL_TERMS)


@pytest.mark.parametrize(
    ("model_type", "expected"),
    [
        ("falcon_h1", LogitTransform(scale=4.0)),
        ("granite", LogitTransform(scale=0.25)),
        ("cohere", LogitTransform(scale=3.0)),
        ("gemma3_text", LogitTransform(softcap=0.5)),
        ("qwen3", LogitTransform()),
    ],
)
def test_the_probe_finds_what_each_model_does_after_its_head(model_type, expected):
    assert probe_logit_transform(_module(model_type, "nll").model) == expected


def test_falcon_h1_lm_head_multiplier_changes_the_loss_and_the_chunked_loss_follows():
    """The issue's case: a multiplier under a name the chunked loss used not to know (nll 5.17, chunked 4.89)."""
    batch = _batch()
    scaled = _module("falcon_h1", "chunked").compute_loss(batch)
    unscaled = _module("falcon_h1", "nll", lm_head_multiplier=1.0).compute_loss(batch)
    assert abs(scaled.item() - unscaled.item()) > 1e-3
    expected = _module("falcon_h1", "nll").compute_loss(batch)
    assert_equal_up_to_rounding(scaled, expected, name="loss", terms=TINY_MODEL_TERMS)


class _TransformsAfterHead(Qwen3ForCausalLM):
    """Stands for a trust_remote_code model: changes its logits after the head, under names we do not know."""

    transform = staticmethod(lambda logits: logits)

    def forward(self, *args, **kwargs):
        output = super().forward(*args, **kwargs)
        output.logits = self.transform(output.logits)
        return output


def _custom_module(transform, loss_type: str = "chunked") -> CausalLMModule:
    torch.manual_seed(0)
    module = CausalLMModule(preset="tiny-qwen3", loss_type=loss_type)
    model = _TransformsAfterHead(build_config("tiny-qwen3"))
    model.transform = transform
    module.model = model.train()
    return module


def test_an_unnamed_multiplier_is_measured_and_applied():
    batch = {"input_ids": _batch()["input_ids"], "labels": _batch()["labels"]}
    chunked = _custom_module(lambda logits: logits * 2.5)
    plain = _custom_module(lambda logits: logits * 2.5, loss_type="nll")
    expected = plain.compute_loss(batch)
    assert_equal_up_to_rounding(chunked.compute_loss(batch), expected, name="loss", terms=TINY_MODEL_TERMS)
    assert_equal_up_to_rounding(chunked.setup_probes.logit_transform.scale, 2.5, name="scale", terms=TINY_MODEL_TERMS)


@pytest.mark.parametrize(
    ("transform", "reason"),
    [
        (lambda logits: 3.0 * torch.tanh(logits / 3.0), "not its LM head's output times"),
        (lambda logits: logits.flip(-1), "not its LM head's output times"),
        (lambda logits: -logits, "do not grow with its LM head's output"),
    ],
)
def test_a_transform_the_chunked_loss_cannot_reproduce_is_refused_naming_nll(transform, reason):
    module = _custom_module(transform)
    with pytest.raises(ValueError, match=rf"(?s){reason}.*Use loss_type='nll'"):
        module.compute_loss(_batch())
    _custom_module(transform, loss_type="nll").compute_loss(_batch())  # the plain loss needs no probe


def test_a_head_that_is_not_a_linear_layer_is_refused():
    module = _custom_module(lambda logits: logits)
    linear = module.model.lm_head
    module.model.lm_head = torch.nn.Sequential(torch.nn.Tanh(), linear)
    module.model.get_output_embeddings = lambda: module.model.lm_head[1]
    with pytest.raises(ValueError, match="does not take the decoder's last hidden state as it is"):
        module.compute_loss(_batch())


def test_the_probe_runs_once_at_fit_start(tmp_path, monkeypatch):
    from lightning.pytorch import Trainer
    from torch.utils.data import DataLoader

    import lit_memtrain.objectives.probes as probes_file

    calls = []
    monkeypatch.setattr(probes_file, "probe_logit_transform", lambda model: calls.append(model) or LogitTransform())
    module = CausalLMModule(preset="tiny-qwen3")
    loader = DataLoader([_batch()] * 2, batch_size=None)
    trainer = Trainer(max_steps=2, logger=False, enable_progress_bar=False, enable_checkpointing=False, default_root_dir=tmp_path)
    trainer.fit(module, loader, loader)
    assert calls == [module.model]


def test_a_model_whose_own_loss_adds_a_z_loss_is_refused_naming_the_setting():
    """Bamba's own loss adds z_loss_coefficient * mean(logsumexp(logits)^2); the module computes the cross-entropy
    itself and left the term out, silently."""
    config = {"model_type": "bamba", **TINY, "mamba_n_heads": 4, "mamba_d_head": 16, "mamba_d_state": 8,
              "attn_layer_indices": [1]}  # fmt: skip
    batch = _batch()
    for loss_type in ("chunked", "nll"):
        torch.manual_seed(0)
        module = CausalLMModule(config={**config, "z_loss_coefficient": 0.1}, loss_type=loss_type)
        module.configure_model()
        own = module.model(**batch, use_cache=False).loss
        cross_entropy = module.model(**batch, use_cache=False).logits  # the module's loss would be this alone
        assert own.item() > torch.nn.functional.cross_entropy(
            cross_entropy[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten()
        ).item() + 1
        with pytest.raises(ValueError, match=r"z_loss_coefficient=0.1 .* config_overrides=\{'z_loss_coefficient': 0\}"):
            module.compute_loss(batch)
    torch.manual_seed(0)
    module = CausalLMModule(config=config)
    module.configure_model()
    assert_equal_up_to_rounding(
        module.compute_loss(batch), module.model(**batch, use_cache=False).loss, name="loss", terms=TINY_MODEL_TERMS
    )


# Packed documents: the architectures that let one document reach the next here: Falcon-H1's Mamba layers, and GPT-OSS
# under eager (transformers builds its masks without position_ids, so packed documents attend to each other: 0.45 per
# token, refused before this probe's tolerance changed too).
CARRY_ACROSS_DOCUMENTS = {"falcon_h1", "gpt_oss"}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("model_type", sorted(ARCHITECTURES))
def test_the_document_probe_passes_every_isolating_architecture_and_refuses_the_others(model_type, dtype):
    """The probe's tolerance comes from the rounding packing shows on each model: no isolating architecture (a
    mixture of experts, whose experts get other token counts when packed, included) is refused in fp32 or bf16."""
    from lit_memtrain.datamodules.padding_free import PaddingFreeCollator

    extra, attention = ARCHITECTURES[model_type]
    torch.manual_seed(0)
    module = CausalLMModule(config={"model_type": model_type, **TINY, **extra}, attn_implementation=attention, dtype=dtype)
    module.configure_model()
    ids = torch.randint(3, TINY["vocab_size"], (12,), generator=torch.Generator().manual_seed(1)).tolist()
    documents = [{"input_ids": ids[:7], "labels": ids[:7]}, {"input_ids": ids[7:], "labels": ids[7:]}]
    flat = PaddingFreeCollator(pad_token_id=0)(documents)
    if model_type not in CARRY_ACROSS_DOCUMENTS:
        module.compute_loss(flat)
        assert module.setup_probes.isolating_attention == attention
        return
    with pytest.raises(ValueError, match="lets packed documents attend to each other"):
        module.compute_loss(flat)
