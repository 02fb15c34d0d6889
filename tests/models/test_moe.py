"""Mixture-of-experts models: the router load-balancing loss is part of the training loss (the model's own
loss, both loss types), and TiledMLP tiles the experts with the untiled step's router gradients."""

from __future__ import annotations

import pytest
import torch
from equivalence import TINY_MODEL_TERMS, assert_each_equal_up_to_rounding, assert_equal_up_to_rounding
from memory_effects import TechniquesInEffect
from torch import nn

from lit_memtrain.callbacks.tiled_mlp import TiledMLP
from lit_memtrain.datamodules.collate import PaddedCollator
from lit_memtrain.models.layers import find_decoder_layers
from lit_memtrain.objectives.causal_lm import CausalLMModule
from lit_memtrain.techniques.tiled_mlp import apply_tiled_mlp

TINY = {
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 128,
    "router_aux_loss_coef": 0.5,  # large enough to move the gradients visibly
}
MOE = {
    "qwen3_moe": {"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16},
    "mixtral": {"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2},
}


def _module(name: str, loss_type: str = "chunked", **kwargs) -> CausalLMModule:
    config = {**TINY, **MOE[name], **kwargs.pop("config", {})}
    torch.manual_seed(0)
    module = CausalLMModule(config=config, loss_type=loss_type, loss_chunk_size=7, **kwargs)
    module.configure_model()
    return module


def _batch(rows: int = 2, length: int = 12) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, TINY["vocab_size"], (rows, length), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[:, :3] = -100
    return {"input_ids": ids, "labels": labels}


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _models_own_loss_and_grads(module: CausalLMModule, batch: dict[str, torch.Tensor]):
    module.model.zero_grad()
    loss = module.model(**batch, output_router_logits=True, use_cache=False).loss
    loss.backward()
    grads = _grads(module.model)
    module.model.zero_grad()
    return loss.detach(), grads


def _assert_the_models_own_loss_and_grads(module: CausalLMModule, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Assert the module's training loss and gradients are the model's own (with the load-balancing loss)."""
    expected_loss, expected_grads = _models_own_loss_and_grads(module, batch)
    loss = module.compute_loss(batch)
    loss.backward()
    assert_equal_up_to_rounding(loss, expected_loss, name="loss", terms=TINY_MODEL_TERMS)
    assert_each_equal_up_to_rounding(_grads(module.model), expected_grads, terms=TINY_MODEL_TERMS)
    return loss


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("loss_type", ["chunked", "nll"])
@pytest.mark.parametrize("name", sorted(MOE))
def test_the_training_loss_is_the_models_own_loss_with_the_load_balancing_loss(name, loss_type, padded):
    module = _module(name, loss_type)
    if padded:
        examples = [{"input_ids": list(range(5, 17)), "labels": [-100] * 3 + list(range(8, 17))},
                    {"input_ids": list(range(20, 27)), "labels": list(range(20, 27))}]
        batch = PaddedCollator(pad_token_id=0)(examples)
    else:
        batch = _batch()
    loss = _assert_the_models_own_loss_and_grads(module, batch)
    cross_entropy_only = module.model(**batch, output_router_logits=False, use_cache=False).loss
    assert loss.item() - cross_entropy_only.item() > 0.5  # 0.5 x a load-balancing loss of about 2


def test_the_coefficient_is_overridable_and_zero_turns_it_off():
    batch = _batch()
    module = _module("qwen3_moe", router_aux_loss_coef=0.0)
    assert module.router_aux_weight() == 0.0
    plain = module.model(**batch, use_cache=False).loss  # the config's output_router_logits is False: no aux
    assert_equal_up_to_rounding(module.compute_loss(batch), plain, name="loss", terms=TINY_MODEL_TERMS)
    doubled = _module("qwen3_moe", router_aux_loss_coef=1.0)
    aux = doubled.model(**batch, output_router_logits=True, use_cache=False).aux_loss
    assert_equal_up_to_rounding(doubled.compute_loss(batch), plain + aux, name="loss", terms=TINY_MODEL_TERMS)


def test_micro_batches_sum_to_the_mean_cross_entropy_plus_the_token_weighted_load_balancing_loss():
    module = _module("mixtral")
    first, second = _batch(rows=1, length=12), _batch(rows=1, length=6)
    counts = [int((b["labels"][:, 1:] != -100).sum()) for b in (first, second)]
    total = sum(counts)
    summed = module.compute_loss(first, num_items=total) + module.compute_loss(second, num_items=total)
    expected = sum(module.compute_loss(b) * n for b, n in zip((first, second), counts)) / total
    assert_equal_up_to_rounding(summed, expected, name="loss", terms=TINY_MODEL_TERMS)


def test_a_coefficient_for_a_model_without_routers_is_refused():
    module = CausalLMModule(preset="tiny-qwen3", router_aux_loss_coef=0.01)
    module.configure_model()
    with pytest.raises(ValueError, match="has no mixture-of-experts routers"):
        module.compute_loss(_batch())
    with pytest.raises(ValueError, match="router_aux_loss_coef must be >= 0"):
        CausalLMModule(preset="tiny-qwen3", router_aux_loss_coef=-1.0)


@pytest.mark.parametrize(
    ("name", "config"),
    [("qwen3_moe", {"mlp_only_layers": [0]}), ("qwen3_moe", {"decoder_sparse_step": 2}), ("mixtral", {})],
)
def test_tiled_experts_give_the_untiled_loss_and_router_gradients_and_dense_layers_are_tiled_too(name, config):
    module = _module(name, config=config)
    batch = _batch(length=30)
    module.compute_loss(batch).backward()
    expected = _grads(module.model)
    assert any("gate.weight" in key for key in expected)  # the routers have gradients
    module.model.zero_grad()
    layers = find_decoder_layers(module.model)
    restore = apply_tiled_mlp(layers, num_tiles=4)
    dense = [layer.mlp for layer in layers if not hasattr(layer.mlp, "experts")]
    experts = [layer.mlp.experts for layer in layers if hasattr(layer.mlp, "experts")]
    assert len(dense) == (1 if config else 0) and len(experts) == (1 if config else 2)
    assert all("forward" in vars(m) for m in dense + experts)
    loss = module.compute_loss(batch)
    loss.backward()
    assert_each_equal_up_to_rounding(_grads(module.model), expected, terms=TINY_MODEL_TERMS)
    restore()
    assert all("forward" not in vars(m) for m in dense + experts)


def test_a_fit_with_tiled_mlp_on_a_mixture_of_experts_model(tmp_path):
    from lightning.pytorch import Trainer
    from torch.utils.data import DataLoader

    module = CausalLMModule(config={**TINY, **MOE["qwen3_moe"]})
    in_effect = TechniquesInEffect()
    trainer = Trainer(
        max_steps=2, callbacks=[TiledMLP(num_tiles=3), in_effect], logger=False, enable_progress_bar=False,
        enable_checkpointing=False, default_root_dir=tmp_path,
    )
    trainer.fit(module, DataLoader([_batch(length=20)] * 2, batch_size=None))
    assert trainer.global_step == 2 and module.last_train_loss is not None
    in_effect.assert_in_effect(checkpointing=False, num_tiles=3)  # the experts ran on tiles of at most 7 tokens


def test_an_experts_layout_it_cannot_tile_is_refused_naming_the_layer():
    class SparseMoeBlock(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate = nn.Linear(8, 2)
            self.experts = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])

    class Layer(nn.Module):
        def __init__(self, sparse: bool) -> None:
            super().__init__()
            self.mlp = SparseMoeBlock() if sparse else nn.Linear(8, 8)

    with pytest.raises(ValueError, match=r"Decoder layer 1 \(Layer\) has a mixture-of-experts 'mlp' \(SparseMoeBlock\)"):
        apply_tiled_mlp([Layer(sparse=False), Layer(sparse=True)])


# Models whose own forward weighs the load-balancing loss by a coefficient under another name than the config's
# router_aux_loss_coef (which they lack): JetMoE's aux_loss_coef, DBRX's ffn_config.moe_loss_weight.
OTHER_COEFFICIENT_NAMES = {
    "jetmoe": {
        "model_type": "jetmoe", "vocab_size": 96, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
        "num_key_value_heads": 2, "kv_channels": 8, "num_local_experts": 4, "num_experts_per_tok": 2,
        "aux_loss_coef": 0.5, "output_router_logits": True,
    },
    "dbrx": {
        "model_type": "dbrx", "vocab_size": 96, "d_model": 32, "n_heads": 4, "n_layers": 2, "max_seq_len": 64,
        "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
        "ffn_config": {"ffn_hidden_size": 48, "moe_num_experts": 4, "moe_top_k": 2, "moe_loss_weight": 0.5},
        "output_router_logits": True,
    },
}  # fmt: skip


@pytest.mark.parametrize("loss_type", ["chunked", "nll"])
@pytest.mark.parametrize("name", sorted(OTHER_COEFFICIENT_NAMES))
def test_a_coefficient_under_the_models_own_name_is_the_one_trained_with(name, loss_type):
    torch.manual_seed(0)
    module = CausalLMModule(config=OTHER_COEFFICIENT_NAMES[name], loss_type=loss_type, attn_implementation="eager")
    module.configure_model()
    assert not hasattr(module.model.config, "router_aux_loss_coef")
    assert module.router_aux_weight() == 0.5
    _assert_the_models_own_loss_and_grads(module, _batch())
