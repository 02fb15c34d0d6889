"""Tiled MLP: the plain model's loss and gradients (alone, with checkpointing and the chunked loss, with LoRA
inside the MLP), only the MLP input saved, the tile count rule, the errors, and the planner's hook choosing the tiles
that run."""

from __future__ import annotations

import pytest
import torch
from equivalence import TINY_MODEL_TERMS, assert_each_equal_up_to_rounding, assert_equal_up_to_rounding
from peft import LoraConfig, get_peft_model
from torch import Tensor, nn
from transformers import AutoModelForCausalLM

from lit_memtrain.callbacks.tiled_mlp import TiledMLP
from lit_memtrain.techniques.checkpointing import apply_checkpointing
from lit_memtrain.models.layers import find_decoder_layers
from lit_memtrain.techniques.loss import chunked_cross_entropy, cross_entropy
from lit_memtrain.models.presets import build_config
from lit_memtrain.techniques.tiled_mlp import apply_tiled_mlp, mlp_tiles, selected_tiles

PRESETS = ["tiny-qwen3", "tiny-llama"]


def _model(preset: str) -> nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(build_config(preset), attn_implementation="sdpa").train()


def _input_ids(model: nn.Module, length: int = 50) -> Tensor:
    return torch.randint(0, model.config.vocab_size, (2, length), generator=torch.Generator().manual_seed(1))


def _targets(input_ids: Tensor) -> Tensor:
    return torch.cat([input_ids[:, 1:], torch.full_like(input_ids[:, :1], -100)], dim=1).flatten()


def _plain_loss(model: nn.Module, input_ids: Tensor) -> Tensor:
    logits = model(input_ids=input_ids, use_cache=False).logits
    return cross_entropy(logits.flatten(0, 1), _targets(input_ids))


def _chunked_loss(model: nn.Module, input_ids: Tensor) -> Tensor:
    hidden = model.get_decoder()(input_ids=input_ids, use_cache=False).last_hidden_state
    weight = model.get_output_embeddings().weight
    return chunked_cross_entropy(hidden.flatten(0, 1), weight, _targets(input_ids), chunk_size=32)


def _loss_and_grads(model: nn.Module, input_ids: Tensor, loss_fn=_plain_loss) -> tuple[Tensor, dict[str, Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = loss_fn(model, input_ids)
    loss.backward()
    grads = {name: param.grad.clone() for name, param in model.named_parameters() if param.grad is not None}
    return loss.detach(), grads


def _assert_same(expected: tuple[Tensor, dict[str, Tensor]], got: tuple[Tensor, dict[str, Tensor]]) -> None:
    assert_equal_up_to_rounding(got[0], expected[0], name="loss", terms=TINY_MODEL_TERMS)
    assert_each_equal_up_to_rounding(got[1], expected[1], terms=TINY_MODEL_TERMS)


@pytest.mark.parametrize("num_tiles", [3, None])
@pytest.mark.parametrize("preset", PRESETS)
def test_tiled_mlp_gives_the_plain_loss_and_gradients(preset, num_tiles):
    model = _model(preset)
    input_ids = _input_ids(model, length=50 if num_tiles else 2500)  # None: 2500 tokens -> 3 tiles of 834
    expected = _loss_and_grads(model, input_ids)
    restore = apply_tiled_mlp(find_decoder_layers(model), num_tiles)
    _assert_same(expected, _loss_and_grads(model, input_ids))
    restore()
    assert all("forward" not in vars(layer.mlp) for layer in find_decoder_layers(model))


@pytest.mark.parametrize("selective", [False, True])
@pytest.mark.parametrize("preset", PRESETS)
def test_composes_with_checkpointing_and_the_chunked_loss(preset, selective):
    model = _model(preset)
    input_ids = _input_ids(model)
    expected = _loss_and_grads(model, input_ids)
    layers = find_decoder_layers(model)
    apply_tiled_mlp(layers, 4)
    apply_checkpointing(layers, selective=selective)
    _assert_same(expected, _loss_and_grads(model, input_ids, _chunked_loss))


def test_lora_inside_the_mlp_gets_the_plain_gradients():
    model = get_peft_model(_model("tiny-qwen3"), LoraConfig(r=4, target_modules=["gate_proj", "up_proj", "down_proj"]))
    for name, param in model.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(param, std=0.02)  # LoRA starts at B = 0; make the adapters matter
    input_ids = _input_ids(model)
    expected = _loss_and_grads(model, input_ids)
    assert any("mlp.gate_proj.lora_A" in name for name in expected[1])
    assert not any("mlp.gate_proj.base_layer" in name for name in expected[1])
    apply_tiled_mlp(find_decoder_layers(model), 3)
    _assert_same(expected, _loss_and_grads(model, input_ids))


def test_lora_dropout_masks_are_replayed_in_backward():
    """With dropout, tiles draw their masks one after another: the reference is the same tiles run with
    autograd, from the same seed. Gradients match only if backward recomputes each tile with the masks its
    forward drew."""
    lora = LoraConfig(r=4, lora_dropout=0.5, target_modules=["gate_proj", "up_proj", "down_proj"])
    layer = find_decoder_layers(get_peft_model(_model("tiny-qwen3"), lora))[0]
    params = [param for param in layer.mlp.parameters() if param.requires_grad]
    x = torch.randn(2, 30, 64, requires_grad=True)
    grad = torch.randn(2, 30, 64)
    results = []
    for tiled in (False, True):
        if tiled:
            apply_tiled_mlp([layer], 3)
        torch.manual_seed(3)
        out = layer.mlp(x) if tiled else torch.cat([layer.mlp(x[:, start : start + 10]) for start in (0, 10, 20)], 1)
        results.append((out.detach(), torch.autograd.grad(out, [x, *params], grad)))
    (expected_out, expected_grads), (out, grads) = results
    terms = 64 + 128 + 60  # one MLP: its sums over the hidden size, the intermediate size, and 60 tokens
    assert_equal_up_to_rounding(out, expected_out, name="output", terms=terms)
    for index, (want, have) in enumerate(zip(expected_grads, grads)):
        assert_equal_up_to_rounding(have, want, name=f"gradient {index}", terms=terms)


def test_no_grad_forward_gives_the_plain_output():
    model = _model("tiny-llama").eval()
    input_ids = _input_ids(model)
    with torch.no_grad():
        expected = model(input_ids=input_ids, use_cache=False).logits
        apply_tiled_mlp(find_decoder_layers(model), 5)
        logits = model(input_ids=input_ids, use_cache=False).logits
        assert_equal_up_to_rounding(logits, expected, name="logits", terms=TINY_MODEL_TERMS)


def test_only_the_mlp_input_is_saved():
    model = _model("tiny-qwen3")
    mlp = find_decoder_layers(model)[0].mlp
    params = {param.untyped_storage().data_ptr() for param in model.parameters()}
    x = torch.randn(2, 40, model.config.hidden_size, requires_grad=True)
    counts = []
    for tiles in (None, 4):
        if tiles:
            apply_tiled_mlp(find_decoder_layers(model), tiles)
        saved: list[Tensor] = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            out = mlp(x)
        out.sum().backward()
        counts.append([t for t in saved if t.untyped_storage().data_ptr() not in params])
    plain, tiled = counts
    assert len(plain) >= 4  # x, gate, act(gate), up... for the plain MLP
    assert len(tiled) == 1 and tiled[0] is x


def test_selected_tiles_run_only_the_tiles_kept():
    model = _model("tiny-qwen3")
    mlp = find_decoder_layers(model)[0].mlp
    x = torch.randn(1, 40, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    expected = mlp(x)
    apply_tiled_mlp(find_decoder_layers(model), 4)
    seen = []

    def last_two(bounds):
        seen.append(bounds)
        return bounds[-2:]

    with torch.no_grad(), selected_tiles(last_two):
        out = mlp(x)
    assert seen == [[(0, 10), (10, 20), (20, 30), (30, 40)]]
    terms = 64 + 128  # one MLP's sums over the hidden and the intermediate size
    assert_equal_up_to_rounding(out[:, 20:], expected[:, 20:], name="kept tiles", terms=terms)
    with torch.no_grad():  # every tile once the context is closed
        assert_equal_up_to_rounding(mlp(x), expected, name="output", terms=terms)
    assert len(seen) == 1


def test_tile_count_rule():
    assert mlp_tiles(65536, 2560) == 26  # Qwen3-4B at 64k: tiles of 2521 tokens
    assert mlp_tiles(262144, 4096) == 64
    assert mlp_tiles(2048, 64) == 2  # small models: tiles of at least 1024 tokens
    assert mlp_tiles(1000, 64) == 1


def test_a_layer_without_mlp_is_a_clear_error():
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.Linear(4, 4)
            self.feed_forward = nn.Linear(4, 4)

    message = "Decoder layer 0 \\(Block\\) has no 'mlp' submodule to tile; its children are: attn, feed_forward"
    with pytest.raises(ValueError, match=message):
        apply_tiled_mlp(nn.ModuleList([Block(), Block()]))


def test_tiling_twice_is_refused():
    layers = find_decoder_layers(_model("tiny-qwen3"))
    apply_tiled_mlp(layers)
    with pytest.raises(ValueError, match="The MLP of decoder layer 0 is already tiled"):
        apply_tiled_mlp(layers, 2)


@pytest.mark.parametrize("num_tiles", [0, 2.5, True])
def test_invalid_tile_counts_are_refused(num_tiles):
    message = f"num_tiles must be a positive int, or None to choose from the sequence; got {num_tiles!r}"
    with pytest.raises(ValueError, match=message):
        TiledMLP(num_tiles=num_tiles)
    with pytest.raises(ValueError, match=message):
        apply_tiled_mlp(nn.ModuleList(), num_tiles)


def test_backward_recomputes_tiles_under_forward_autocast():
    from lit_memtrain.techniques.tiled_mlp import apply_tiled_mlp as tile

    dtypes = []
    mlp = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.SiLU(), torch.nn.Linear(32, 16))
    mlp[0].register_forward_hook(lambda module, args, out: dtypes.append(out.dtype))
    layer = torch.nn.Module()
    layer.mlp = mlp
    tile([layer], num_tiles=2)
    x = torch.randn(1, 8, 16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer.mlp(x)
    out.float().sum().backward()
    assert dtypes and set(dtypes) == {torch.bfloat16}  # forward tiles and backward recomputation alike
