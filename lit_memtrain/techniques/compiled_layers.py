"""``torch.compile`` of each decoder layer: a small model's elementwise work fused, one compilation for every layer.

Why: on a GPU, a step of a small model (Qwen3-0.6B: hidden 1024) spends much of its time in memory-bound
elementwise kernels that eager PyTorch launches one by one: RMSNorm's fp32 round trip, the query/key norms, RoPE,
SiLU times up, the residual additions. Compiled, they fuse into a few kernels around the matrix products.

Why per layer, not the whole model (torchtitan's way): every decoder layer runs the same code on the same
shapes, and graph capture lifts a layer's parameters to inputs, so one compilation serves all of them: compile
time is one layer's, whatever the depth. What runs outside the layers (embedding, chunked loss, optimizer) stays
as it is.

What stays eager inside a layer: this package's attention implementations (``sdpa_by_document``,
``varlen_by_document``) are excluded from graph capture where they are registered: they read each packed row's
document bounds on the host, and a captured graph would specialise on them, compiling again for every new
packing. The layer is captured as two graphs, before and after attention.

Composition is not assumed: layers whose ``forward`` (or a submodule's) another technique already wrapped are
refused, as is transformers' own gradient checkpointing. Checkpointing around a compiled layer, for one, fell
back to eager in a first try (the checkpoint region cannot contain the side effect of transformers' kernel-hub
decorator). :class:`~lit_memtrain.callbacks.CompiledLayers` refuses the technique callbacks and strategies of
several processes the same way.

Example::

    restore = compile_layers(find_decoder_layers(model))
    ...  # train
    restore()
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from lit_memtrain.models.layers import wrap_forwards

__all__ = ["COMPILE_MODES", "compile_layers", "wrapped_forwards"]

# torch.compile's modes that capture no CUDA graphs: a packed row's attention runs eagerly between a layer's two
# graphs, with bounds that change at every step.
COMPILE_MODES = (None, "default", "max-autotune-no-cudagraphs")


def wrapped_forwards(layers: Sequence[nn.Module]) -> list[str]:
    """The modules of ``layers`` (and their submodules) whose ``forward`` something replaced on the instance, and
    the layers with transformers' gradient checkpointing on, as names (``"layers.0.mlp"``)."""
    found = []
    for index, layer in enumerate(layers):
        for name, module in layer.named_modules(prefix=f"layers.{index}"):
            if "forward" in vars(module):
                found.append(name)
            elif module is layer and getattr(layer, "gradient_checkpointing", False):
                found.append(f"{name} (transformers' gradient checkpointing)")
    return found


def compile_layers(
    layers: Sequence[nn.Module], *, mode: str | None = None, dynamic: bool | None = None, backend: str = "inductor"
) -> Callable[[], None]:
    """Compile each layer's ``forward`` with ``torch.compile(mode=..., dynamic=..., backend=...)``; returns a
    function that puts the eager ``forward`` back.

    Raises:
        ValueError: an unknown or CUDA-graph ``mode``, no layers, or layers another technique already wrapped.
    """
    if mode not in COMPILE_MODES:
        raise ValueError(
            f"mode must be one of {COMPILE_MODES}, got {mode!r}: the CUDA-graph modes ('reduce-overhead', "
            "'max-autotune') would record a graph around attention that runs eagerly with bounds changing every step."
        )
    if not layers:
        raise ValueError("compile_layers got no layers to compile.")
    wrapped = wrapped_forwards(layers)
    if wrapped:
        raise ValueError(
            f"compile_layers compiles plain decoder layers, but another technique already wrapped "
            f"{', '.join(wrapped[:4])}{' and more' if len(wrapped) > 4 else ''}: compiling through it is not shown "
            "to give the same gradients. Compile without it, or run that technique without compiling."
        )
    options = {"mode": mode, "dynamic": dynamic, "backend": backend}
    return wrap_forwards(layers, lambda module, forward: torch.compile(forward, **options))
