"""Wrapping a module's ``forward`` on the instance (``wrap_forwards``, ``run_inside_forward``) leaves no reference
cycle: a model a user drops is freed at once, by reference counting, without the garbage collector."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from equivalence import TINY_MODEL_TERMS, assert_each_equal_up_to_rounding
from transformers import AutoModelForCausalLM

from lit_memtrain.models.layers import find_decoder_layers
from lit_memtrain.models.presets import build_config
from lit_memtrain.parallel.fsdp import run_inside_forward
from lit_memtrain.techniques.checkpointing import apply_checkpointing
from lit_memtrain.techniques.rms_norm import apply_chunked_rms_norm
from lit_memtrain.techniques.tiled_mlp import apply_tiled_mlp

TECHNIQUES = {
    "checkpointing": lambda model: apply_checkpointing(find_decoder_layers(model)),
    "offloaded checkpointing": lambda model: apply_checkpointing(find_decoder_layers(model), offload=True),
    "tiled MLP": lambda model: apply_tiled_mlp(find_decoder_layers(model), num_tiles=2),
    "chunked RMS norm": lambda model: apply_chunked_rms_norm(model.modules(), chunk_elements=64)[0],
}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = build_config("tiny-qwen3", {"num_hidden_layers": 2})
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def _loss(model: torch.nn.Module) -> torch.Tensor:
    input_ids = torch.arange(16)[None] % 100
    return model(input_ids=input_ids, labels=input_ids, use_cache=False).loss


@pytest.fixture
def no_garbage_collection():
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@pytest.mark.parametrize("technique", TECHNIQUES)
def test_a_wrapped_model_is_freed_without_the_garbage_collector(technique, no_garbage_collection):
    model = _model()
    restore = TECHNIQUES[technique](model)
    wrapped = [module for module in model.modules() if "forward" in vars(module)]
    assert wrapped  # the technique did set forwards on the instances
    _loss(model).backward()
    references = [weakref.ref(model), weakref.ref(find_decoder_layers(model)[0]), *map(weakref.ref, wrapped)]
    del model, wrapped, restore
    assert [reference() is None for reference in references] == [True] * len(references)


@pytest.mark.parametrize("technique", TECHNIQUES)
def test_a_wrapped_model_trains_as_before_and_restores(technique):
    model = _model()
    state = {name: value.clone() for name, value in model.state_dict().items()}
    _loss(model).backward()
    expected = {name: param.grad.clone() for name, param in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    restore = TECHNIQUES[technique](model)
    assert model.state_dict().keys() == state.keys()
    _loss(model).backward()
    grads = {name: param.grad for name, param in model.named_parameters()}
    assert_each_equal_up_to_rounding(grads, expected, terms=TINY_MODEL_TERMS)
    restore()
    assert not [name for name, module in model.named_modules() if "forward" in vars(module)]


def test_run_inside_forward_leaves_no_forward_and_no_cycle(no_garbage_collection):
    model = _model()
    hidden = run_inside_forward(model, lambda ids: model.model(input_ids=ids).last_hidden_state, torch.ones(1, 4).long())
    assert hidden.shape == (1, 4, model.config.hidden_size) and "forward" not in vars(model)
    reference = weakref.ref(model)
    del model, hidden
    assert reference() is None
