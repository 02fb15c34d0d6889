"""Gradient checkpointing: the plain model's loss and gradients, exact saved-tensor counts, offload catches each
layer's input, and the callback on a user's own LightningModule under a real Trainer."""

from __future__ import annotations

import weakref

import lightning as L
import pytest
import torch
from equivalence import TINY_MODEL_TERMS, assert_each_equal_up_to_rounding, assert_equal_up_to_rounding
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader, TensorDataset
from transformers import AutoModelForCausalLM

import lit_memtrain.techniques.checkpointing as checkpointing
from lit_memtrain.callbacks.gradient_checkpointing import GradientCheckpointing
from lit_memtrain.callbacks.tiled_mlp import TiledMLP
from lit_memtrain.techniques.checkpointing import apply_checkpointing, attention_ops
from lit_memtrain.models.layers import find_decoder_layers
from lit_memtrain.techniques.loss import cross_entropy
from lit_memtrain.models.presets import build_config

PRESETS = ["tiny-qwen3", "tiny-llama"]
MODES = {"full": {}, "selective": {"selective": True}, "offload": {"offload": True}}


def _model(preset: str) -> nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(build_config(preset), attn_implementation="sdpa").train()


def _input_ids(model: nn.Module, rows: int = 2, length: int = 48) -> Tensor:
    return torch.randint(0, model.config.vocab_size, (rows, length), generator=torch.Generator().manual_seed(1))


def _loss(model: nn.Module, input_ids: Tensor) -> Tensor:
    targets = torch.cat([input_ids[:, 1:], torch.full_like(input_ids[:, :1], -100)], dim=1)
    logits = model(input_ids=input_ids, use_cache=False).logits
    return cross_entropy(logits.flatten(0, 1), targets.flatten())


def _loss_and_grads(model: nn.Module, input_ids: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = _loss(model, input_ids)
    loss.backward()
    return loss.detach(), {name: param.grad.clone() for name, param in model.named_parameters()}


def _assert_same(expected: tuple[Tensor, dict[str, Tensor]], got: tuple[Tensor, dict[str, Tensor]]) -> None:
    assert_equal_up_to_rounding(got[0], expected[0], name="loss", terms=TINY_MODEL_TERMS)
    assert_each_equal_up_to_rounding(got[1], expected[1], terms=TINY_MODEL_TERMS)


class _SavedPerLayer:
    """Records, per decoder layer, the layer's input and every tensor autograd saves while the layer runs.

    Module hooks run outside the layer's (patched) forward, so what is seen here is what the layer keeps
    for backward: the checkpoint's input, or every activation without checkpointing.
    """

    def __init__(self, layers: nn.ModuleList) -> None:
        self.inputs: list[Tensor] = []
        self.saved: list[list[Tensor]] = []
        self._contexts: list[torch.autograd.graph.saved_tensors_hooks] = []
        for layer in layers:
            layer.register_forward_pre_hook(self._enter)
            layer.register_forward_hook(self._exit)

    def _enter(self, module: nn.Module, args: tuple) -> None:
        self.inputs.append(args[0])
        saved: list[Tensor] = []
        self.saved.append(saved)
        context = torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t)
        context.__enter__()
        self._contexts.append(context)

    def _exit(self, module: nn.Module, args: tuple, output: object) -> None:
        self._contexts.pop().__exit__(None, None, None)


class _AttentionOutputs(TorchDispatchMode):
    """Weak references to the storages of every attention kernel output, to count those still alive."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: list[weakref.ref] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if func in attention_ops():
            self.storages += [weakref.ref(t.untyped_storage()) for t in out if isinstance(t, Tensor)]
        return out

    def alive(self) -> int:
        return sum(ref() is not None for ref in self.storages)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("preset", PRESETS)
def test_checkpointing_gives_the_plain_loss_and_gradients(preset, mode):
    model = _model(preset)
    input_ids = _input_ids(model)
    expected = _loss_and_grads(model, input_ids)
    restore = apply_checkpointing(find_decoder_layers(model), **MODES[mode])
    _assert_same(expected, _loss_and_grads(model, input_ids))
    restore()
    _assert_same(expected, _loss_and_grads(model, input_ids))


@pytest.mark.parametrize("preset", PRESETS)
def test_saved_tensors_one_per_layer_plus_attention_outputs_when_selective(preset):
    counts = {}
    for mode in (None, "full", "selective"):
        model = _model(preset)
        layers = find_decoder_layers(model)
        if mode is not None:
            apply_checkpointing(layers, selective=mode == "selective")
        recorder = _SavedPerLayer(layers)
        with _AttentionOutputs() as attention:
            loss = _loss(model, _input_ids(model))
        counts[mode] = ([len(saved) for saved in recorder.saved], attention.alive())
        if mode is not None:
            for layer_input, saved in zip(recorder.inputs, recorder.saved):
                assert saved[0] is layer_input
        loss.backward()
    n = len(layers)
    # Without checkpointing each layer keeps dozens of tensors, among them the attention output and its
    # log-sum-exp for the kernel's backward.
    assert all(count > 10 for count in counts[None][0])
    assert counts[None][1] == 2 * n
    # Full: the layer input only; the attention outputs are freed with the rest and recomputed.
    assert counts["full"] == ([1] * n, 0)
    # Selective: the layer input, and the attention output and log-sum-exp kept by the checkpoint's policy.
    assert counts["selective"] == ([1] * n, 2 * n)


def test_offload_moves_exactly_each_layer_input(monkeypatch):
    packed: list[Tensor] = []

    class RecordingSaveOnCpu(torch.autograd.graph.save_on_cpu):
        def __init__(self, pin_memory: bool) -> None:
            super().__init__(pin_memory=pin_memory)
            pack = self.pack_hook
            self.pack_hook = lambda tensor: packed.append(tensor) or pack(tensor)

    monkeypatch.setattr(checkpointing, "save_on_cpu", RecordingSaveOnCpu)
    model = _model("tiny-qwen3")
    layers = find_decoder_layers(model)
    apply_checkpointing(layers, offload=True)
    inputs = []
    for layer in layers:
        layer.register_forward_pre_hook(lambda module, args: inputs.append(args[0]))
    _loss(model, _input_ids(model)).backward()
    assert len(packed) == len(layers)
    for tensor, layer_input in zip(packed, inputs):
        assert tensor is layer_input


def test_checkpointing_twice_is_refused():
    model = _model("tiny-qwen3")
    layers = find_decoder_layers(model)
    restore = apply_checkpointing(layers)
    with pytest.raises(ValueError, match="Decoder layer 0 .* is already checkpointed"):
        apply_checkpointing(layers, selective=True)
    restore()
    assert all("forward" not in vars(layer) for layer in layers)
    model.activation_checkpointing_enable()
    with pytest.raises(ValueError, match="gradient_checkpointing_disable"):
        apply_checkpointing(layers)


class UserModule(L.LightningModule):
    """A user's own LightningModule: an HF causal LM trained with its built-in loss, nothing of ours."""

    def __init__(self, preset: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = AutoModelForCausalLM.from_config(build_config(preset))
        self.recorder = _SavedPerLayer(self.model.model.layers)
        self.use_cache_seen: list[bool] = []

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        self.use_cache_seen.append(self.model.config.use_cache)
        return self.model(input_ids=batch[0], labels=batch[0]).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


def _fit(module: L.LightningModule, callbacks: list[L.Callback]) -> None:
    data = torch.randint(0, 512, (4, 40), generator=torch.Generator().manual_seed(2))
    trainer = L.Trainer(
        max_steps=2,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    trainer.fit(module, DataLoader(TensorDataset(data), batch_size=2))


def test_trainer_with_a_user_module_trains_like_the_plain_model():
    plain = UserModule("tiny-qwen3")
    _fit(plain, [])
    module = UserModule("tiny-qwen3")
    _fit(module, [GradientCheckpointing(selective=True), TiledMLP(num_tiles=3)])
    for (name, expected), got in zip(plain.model.named_parameters(), module.model.parameters()):
        assert_equal_up_to_rounding(got, expected, name=name, terms=TINY_MODEL_TERMS)  # SGD: at the weights' scale
    n = len(module.model.model.layers)
    assert [len(saved) for saved in module.recorder.saved] == [1] * (2 * n)
    assert all(len(saved) > 10 for saved in plain.recorder.saved)
    assert module.use_cache_seen == [False, False]
    # Restored after fit: plain forwards, cache back on for generation.
    assert module.model.config.use_cache is True
    for layer in module.model.model.layers:
        assert "forward" not in vars(layer) and "forward" not in vars(layer.mlp)


def test_layers_path_selects_the_layers():
    module = UserModule("tiny-llama")
    callback = GradientCheckpointing(layers_path="model.model.layers")
    callback.on_fit_start(None, module)
    _loss(module.model, _input_ids(module.model)).backward()
    callback.teardown(None, module, "fit")
    _loss(module.model, _input_ids(module.model)).backward()
    assert [len(saved) for saved in module.recorder.saved[:2]] == [1, 1]
    assert all(len(saved) > 10 for saved in module.recorder.saved[2:])
    with pytest.raises(ValueError, match="has no attribute path 'model.layers'"):
        GradientCheckpointing(layers_path="model.layers").on_fit_start(None, module)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"selective": "yes"}, TypeError, "selective must be True or False, got 'yes'"),
        ({"offload": 1}, TypeError, "offload must be True or False, got 1"),
        ({"layers_path": ""}, ValueError, "layers_path must be a dotted attribute path"),
    ],
)
def test_invalid_arguments_are_refused(kwargs, error, message):
    with pytest.raises(error, match=message):
        GradientCheckpointing(**kwargs)



_ATTENTION_CALLS: list[float] = []


@torch.library.custom_op("lit_memtrain_tests::attention_with_dropout", mutates_args=())
def _attention_with_dropout(x: torch.Tensor, dropout_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Stands in for CUDA's attention kernels that apply dropout themselves (the CPU's do not): draws its mask from
    the generator inside the op."""
    _ATTENTION_CALLS.append(dropout_p)
    if dropout_p == 0:  # no dropout, no random numbers drawn (as the real kernels)
        return x.softmax(-1), torch.ones_like(x)
    mask = (torch.rand_like(x) >= dropout_p).to(x.dtype) / (1 - dropout_p)
    return x.softmax(-1) * mask, mask


@_attention_with_dropout.register_fake
def _(x, dropout_p):
    return torch.empty_like(x), torch.empty_like(x)


def _attention_backward(ctx, grad, _):
    (probs, mask) = ctx.saved_tensors
    grad = grad * mask
    return probs * (grad - (grad * probs).sum(-1, keepdim=True)), None


_attention_with_dropout.register_autograd(
    _attention_backward, setup_context=lambda ctx, inputs, output: ctx.save_for_backward(inputs[0].softmax(-1), output[1])
)


@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
def test_selective_checkpointing_keeps_no_attention_that_draws_random_numbers(dropout_p, monkeypatch):
    """A kept attention op does not run again in the recomputation, so the random numbers it drew were not drawn
    again and the residual dropout after it drew other masks in backward than in forward: gradients of another
    function than the loss (CUDA's attention kernels with dropout). Kept only without dropout."""
    import lit_memtrain.techniques.checkpointing as checkpointing

    op = torch.ops.lit_memtrain_tests.attention_with_dropout.default
    monkeypatch.setattr(checkpointing, "attention_ops", lambda: [op])

    class Layer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            attended, _ = torch.ops.lit_memtrain_tests.attention_with_dropout(self.proj(x), dropout_p)
            return x + torch.nn.functional.dropout(self.proj(attended), 0.5, training=True)

    torch.manual_seed(0)
    layers = torch.nn.ModuleList([Layer(), Layer()])
    x = torch.randn(4, 16)

    def gradients() -> list[torch.Tensor]:
        layers.zero_grad()
        torch.manual_seed(1)
        layers[1](layers[0](x)).square().sum().backward()
        return [p.grad.clone() for p in layers.parameters()]

    expected = gradients()
    restore = apply_checkpointing(layers, selective=True)
    _ATTENTION_CALLS.clear()
    got = gradients()
    restore()
    assert_each_equal_up_to_rounding(dict(zip([n for n, _ in layers.named_parameters()], got)),
                                     dict(zip([n for n, _ in layers.named_parameters()], expected)), terms=64)
    assert len(_ATTENTION_CALLS) == (2 if dropout_p == 0 else 4)  # kept without dropout, recomputed with it
