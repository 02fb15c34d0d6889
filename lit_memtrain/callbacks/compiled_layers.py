"""Lightning callback compiling every decoder layer with ``torch.compile`` for the fit.

Why a callback: compiling is a property of the run, like checkpointing, and must work on a user's own
LightningModule holding a Hugging Face causal LM. The layers are found when the fit starts and their eager
``forward`` is restored when it ends, so exporting or generating afterwards sees the plain model.

What is compiled and why per layer: :mod:`lit_memtrain.techniques.compiled_layers`. What it is for: speed on a
GPU, where a small model's eager step launches its elementwise work kernel by kernel; memory is planned as eager
(``lit-memtrain plan`` does not simulate it). Refused with what it is not shown to compose with (the memory
technique callbacks, strategies of several processes): a compiled layer must give the eager layer's gradients.
"""

from __future__ import annotations

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.utilities import rank_zero_info

from lit_memtrain.callbacks.activation_offloading import ActivationOffloading
from lit_memtrain.callbacks.chunked_rms_norm import ChunkedRMSNorm
from lit_memtrain.callbacks.gradient_checkpointing import GradientCheckpointing
from lit_memtrain.callbacks.restored_at_fit_end import RestoredAtFitEnd
from lit_memtrain.callbacks.tiled_mlp import TiledMLP
from lit_memtrain.models.layers import find_decoder_layers, validate_layers_path
from lit_memtrain.techniques.compiled_layers import COMPILE_MODES, compile_layers

__all__ = ["CompiledLayers"]

_NOT_COMPOSED = (GradientCheckpointing, TiledMLP, ChunkedRMSNorm, ActivationOffloading)


class CompiledLayers(RestoredAtFitEnd):
    """``torch.compile`` of each decoder layer during ``fit``, on one device.

    Args:
        mode: ``torch.compile``'s mode among those without CUDA graphs: ``None`` (its default),
            ``"default"``, ``"max-autotune-no-cudagraphs"``.
        dynamic: ``torch.compile``'s ``dynamic`` (``None``: static shapes first, dynamic once a shape changes).
        backend: ``torch.compile``'s backend (``"inductor"``; ``"aot_eager"`` captures without generating code).
        layers_path: dotted path to the decoder layer list from the LightningModule when it cannot be
            found automatically (for example ``"model.model.layers"``).

    Example:
        >>> from lit_memtrain.callbacks.compiled_layers import CompiledLayers
        >>> trainer = Trainer(callbacks=[CompiledLayers()])  # doctest: +SKIP
    """

    def __init__(
        self,
        mode: str | None = None,
        dynamic: bool | None = None,
        backend: str = "inductor",
        layers_path: str | None = None,
    ) -> None:
        if mode not in COMPILE_MODES:
            raise ValueError(
                f"mode must be one of {COMPILE_MODES}, got {mode!r}: the CUDA-graph modes would record a graph around "
                "attention that runs eagerly with bounds changing every step."
            )
        if dynamic is not None and not isinstance(dynamic, bool):
            raise TypeError(f"dynamic must be None, True or False, got {dynamic!r}.")
        if not isinstance(backend, str) or not backend:
            raise ValueError(f"backend must name a torch.compile backend such as 'inductor', got {backend!r}.")
        validate_layers_path(layers_path)
        self.mode = mode
        self.dynamic = dynamic
        self.backend = backend
        self.layers_path = layers_path

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        others = [type(callback).__name__ for callback in trainer.callbacks if isinstance(callback, _NOT_COMPOSED)]
        if others:
            raise ValueError(
                f"CompiledLayers does not run with {', '.join(others)}: compiling through a memory technique is not "
                "shown to give the same gradients. Remove CompiledLayers, or the technique."
            )
        if type(trainer.strategy) is not SingleDeviceStrategy:
            raise ValueError(
                f"CompiledLayers runs on one device, not under {type(trainer.strategy).__name__}: compiled layers "
                "under several processes are not shown to give one process's gradients yet."
            )
        try:
            layers = find_decoder_layers(pl_module, self.layers_path)
        except ValueError as error:
            raise ValueError(f"CompiledLayers has no decoder layers to compile: {error}") from error
        self._restore = compile_layers(layers, mode=self.mode, dynamic=self.dynamic, backend=self.backend)
        rank_zero_info(f"CompiledLayers: {len(layers)} decoder layers compiled (torch.compile, {self.backend} backend)")
