"""What the memory techniques did during a fit, seen from the decoder layers (a test callback and its checks).

Why: "trains as without them" holds just as well when a technique silently does nothing, so the fits that compare
losses also check that each technique acted, by what it does rather than by how it is set up:

- checkpointing recomputes every layer in backward: each decoder layer's attention runs as often inside backward
  (between Lightning's ``on_before_backward`` and ``on_after_backward``) as in the training forwards;
- a tiled MLP runs its activation on tiles: each MLP call of a training forward calls its activation once per
  tile (a dense MLP, or experts computed together as transformers does on CPU; untiled, once per MLP call);
- activation offloading counts what it moved: its offloader's step statistics gain bytes in every layer before
  each backward (a step of GRPO or RLOO runs a forward and a backward per slice: offloading that ends at the first
  backward would leave the later slices' activations on the device).

Place :class:`TechniquesInEffect` after the technique callbacks, so it sees the layers as they left them.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import Callback
from torch import nn

from lit_memtrain.callbacks import ActivationOffloading
from lit_memtrain.models.layers import find_decoder_layers


class TechniquesInEffect(Callback):
    """Counts, over a fit, attention calls in training forwards and in backward, and the tokens of each MLP
    activation call within each MLP call of a training forward."""

    def __init__(self) -> None:
        self.attention_in_forward = 0
        self.attention_in_backward = 0
        self.backwards = 0
        self.activation_calls: list[list[int]] = []  # per MLP call of a training forward: tokens per activation call
        self.offloaded_per_backward: list[list[int]] = []  # per backward: bytes each layer offloaded since the last
        self._offloading: ActivationOffloading | None = None
        self._offloaded: tuple[Any, list[int]] | None = None  # the offloader's statistics and their bytes then
        self._in_backward = False
        self._in_training_mlp = False
        self._handles: list[Any] = []

    def on_fit_start(self, trainer, pl_module) -> None:
        layers = find_decoder_layers(pl_module)
        self._offloading = next((c for c in trainer.callbacks if isinstance(c, ActivationOffloading)), None)
        activations = {id(m): m for layer in layers for name, m in layer.mlp.named_modules() if name.endswith("act_fn")}
        self._handles = [
            *(layer.self_attn.register_forward_pre_hook(self._attention) for layer in layers),
            *(layer.mlp.register_forward_pre_hook(self._mlp) for layer in layers),
            *(activation.register_forward_pre_hook(self._activation) for activation in activations.values()),
        ]

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self._in_backward = True
        self.backwards += 1
        if self._offloading is not None:  # the statistics start anew with each training step
            stats = self._offloading.offloader.stats
            same_step = self._offloaded is not None and self._offloaded[0] is stats
            before = self._offloaded[1] if same_step else [0] * len(stats.bytes_per_layer)
            self.offloaded_per_backward.append([now - then for now, then in zip(stats.bytes_per_layer, before)])
            self._offloaded = (stats, list(stats.bytes_per_layer))

    def on_after_backward(self, trainer, pl_module) -> None:
        self._in_backward = False

    def teardown(self, trainer, pl_module, stage: str) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _attention(self, module: nn.Module, args: Any) -> None:
        if self._in_backward:
            self.attention_in_backward += 1
        elif torch.is_grad_enabled():
            self.attention_in_forward += 1

    def _mlp(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        self._in_training_mlp = torch.is_grad_enabled() and not self._in_backward
        if self._in_training_mlp:
            self.activation_calls.append([])

    def _activation(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if self._in_training_mlp and not self._in_backward:
            self.activation_calls[-1].append(args[0].numel() // args[0].shape[-1])

    def assert_in_effect(
        self, checkpointing: bool = True, num_tiles: int | None = 2, offloading: ActivationOffloading | None = None
    ) -> None:
        """Each technique named acted on every decoder layer (``num_tiles=None``: no tiled MLP was added)."""
        assert self.backwards > 0 and self.attention_in_forward > 0, "no training forward and backward seen"
        if checkpointing:  # every layer's forward ran again in backward
            assert self.attention_in_backward == self.attention_in_forward, (
                f"checkpointing: {self.attention_in_backward} attention calls recomputed in backward for "
                f"{self.attention_in_forward} in training forwards"
            )
        if num_tiles is not None:
            assert self.activation_calls, "no MLP ran in a training forward"
            for tokens in self.activation_calls:
                assert len(tokens) == num_tiles, f"tiled MLP: an MLP call ran its activation on {tokens} tokens"
        if offloading is not None:
            stats = offloading.offloader.stats
            assert all(stats.bytes_per_layer) and stats.tensors > 0, f"offloading moved {stats} in its last step"
            assert len(self.offloaded_per_backward) == self.backwards, "offloading was not seen by this callback"
            for index, moved in enumerate(self.offloaded_per_backward):
                assert all(moved), f"offloading: the forward before backward {index} moved {moved} bytes per layer"
