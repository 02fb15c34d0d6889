"""Sequence-tiled MLP (Arctic Long Sequence Training, arXiv 2506.13996).

Why: once the logits are chunked and the layers checkpointed, the largest tensors of a step are the MLP
intermediates while a layer runs its backward: gate, up, act(gate) and their product, each L x I (Qwen3-4B,
I = 9728: 19 GB each at 1M tokens in bf16). The MLP acts on every token independently, so it can run over
the sequence a tile of tokens at a time. Forward runs the tiles without autograd and keeps only the MLP
input; backward recomputes one tile at a time with autograd on, takes that tile's gradients and frees its
intermediates before the next tile. The I-wide working set shrinks by the number of tiles; the price is one
more MLP forward per step.

Tile count rule (``num_tiles=None``): ``ceil(L / max(H, 1024))``, i.e. tiles of about H tokens as ALST
chooses. One tile's I-wide intermediates are then about ``H x I`` elements each, the size of one MLP weight
matrix, so the MLP transient stays at the scale of the weights at any sequence length; the 1024-token floor
keeps small models from running many tiny, slow matmuls.

The random state is replayed in backward (CPU and CUDA generators), so dropout inside the MLP (LoRA's)
draws the same masks when a tile is recomputed. Tiles draw their masks one after another, so they differ
from the masks of an untiled call with the same seed (equally valid, not equal).

Parameter gradients are summed over tiles in the parameters' dtype and returned from the autograd function
(not accumulated into ``.grad`` per tile), so gradient hooks (FSDP2, DDP) fire once per step. The
parameters are collected at each call from ``mlp.parameters()`` (those requiring grad), so LoRA adapters
inside the MLP and FSDP2's unsharded parameters are included.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn

from lit_memtrain.autocast import active_autocast_dtype
from lit_memtrain.layers import wrap_forwards

__all__ = ["apply_tiled_mlp", "mlp_tiles", "validate_num_tiles"]

_MIN_TILE_TOKENS = 1024
_MARKER = "_lit_memtrain_tiled"


def mlp_tiles(seq_len: int, hidden_size: int) -> int:
    """Number of sequence tiles for an MLP over ``seq_len`` tokens: ``ceil(seq_len / max(hidden_size, 1024))``."""
    return max(1, math.ceil(seq_len / max(hidden_size, _MIN_TILE_TOKENS)))


def validate_num_tiles(num_tiles: int | None) -> None:
    """Raise ``ValueError`` unless ``num_tiles`` is a positive int or ``None`` (chosen per call)."""
    if num_tiles is not None and (isinstance(num_tiles, bool) or not isinstance(num_tiles, int) or num_tiles < 1):
        raise ValueError(f"num_tiles must be a positive int, or None to choose from the sequence; got {num_tiles!r}.")


def _tile_bounds(length: int, num_tiles: int) -> list[tuple[int, int]]:
    num_tiles = min(num_tiles, length)
    size = math.ceil(length / num_tiles)
    return [(start, min(start + size, length)) for start in range(0, length, size)]


class _TiledMLPFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, forward: Callable[[Tensor], Tensor], num_tiles: int, x: Tensor, *params: Tensor) -> Tensor:
        bounds = _tile_bounds(x.shape[-2], num_tiles)
        # Dropout inside the MLP (LoRA's) must draw the same masks when backward recomputes the tiles.
        ctx.rng_states = (torch.get_rng_state(), torch.cuda.get_rng_state(x.device) if x.is_cuda else None)
        # Autocast is off inside a custom backward: remember it so the recomputed tiles match forward's dtypes.
        autocast_dtype = active_autocast_dtype(x.device.type)
        ctx.autocast = (x.device.type, autocast_dtype) if autocast_dtype is not None else None
        inputs = x.detach()  # tiles of x itself would be views that claim requires_grad without a grad_fn
        out: Tensor | None = None
        for start, end in bounds:
            tile_out = forward(inputs[..., start:end, :])
            if out is None:
                out = tile_out.new_empty((*x.shape[:-1], tile_out.shape[-1]))
            out[..., start:end, :] = tile_out
        ctx.forward = forward
        ctx.bounds = bounds
        ctx.save_for_backward(x, *params)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        x, *params = ctx.saved_tensors
        needs_x = ctx.needs_input_grad[2]
        grad_x = torch.empty_like(x) if needs_x else None
        grad_params: list[Tensor | None] = [None] * len(params)
        cpu_state, cuda_state = ctx.rng_states
        with torch.random.fork_rng(devices=[x.device] if cuda_state is not None else []):
            torch.set_rng_state(cpu_state)
            if cuda_state is not None:
                torch.cuda.set_rng_state(cuda_state, x.device)
            for start, end in ctx.bounds:
                x_tile = x[..., start:end, :].detach().requires_grad_(needs_x)
                autocast = torch.autocast(*ctx.autocast) if ctx.autocast else contextlib.nullcontext()
                with torch.enable_grad(), autocast:
                    tile_out = ctx.forward(x_tile)
                inputs = [x_tile, *params] if needs_x else params
                grads = torch.autograd.grad(tile_out, inputs, grad_out[..., start:end, :], allow_unused=True)
                if needs_x:
                    grad_x[..., start:end, :] = grads[0]
                    grads = grads[1:]
                for index, grad in enumerate(grads):
                    if grad is None:
                        continue
                    if grad_params[index] is None:
                        grad_params[index] = grad
                    else:
                        grad_params[index] += grad
        return None, None, grad_x, *grad_params


def _tiled(mlp: nn.Module, forward: Callable[[Tensor], Tensor], num_tiles: int | None) -> Callable[[Tensor], Tensor]:
    def tiled_forward(x: Tensor) -> Tensor:
        tiles = num_tiles if num_tiles is not None else mlp_tiles(x.shape[-2], x.shape[-1])
        if min(tiles, x.shape[-2]) <= 1:
            return forward(x)
        params = [param for param in mlp.parameters() if param.requires_grad]
        return _TiledMLPFunction.apply(forward, tiles, x, *params)

    setattr(tiled_forward, _MARKER, True)
    return tiled_forward


def apply_tiled_mlp(layers: Iterable[nn.Module], num_tiles: int | None = None) -> Callable[[], None]:
    """Run the ``mlp`` of every decoder layer over the sequence in tiles.

    Args:
        layers: decoder layers, each with an ``mlp`` submodule taking [..., L, H] (see
            :func:`lit_memtrain.layers.find_decoder_layers`).
        num_tiles: tiles per MLP call; ``None`` picks :func:`mlp_tiles` from each call's L and H.

    Returns:
        A function that restores the MLPs' original ``forward``.

    Raises:
        ValueError: ``num_tiles`` is not a positive int, a layer has no ``mlp`` submodule, or an MLP is
            already tiled.

    Example:
        >>> restore = apply_tiled_mlp(find_decoder_layers(model))  # doctest: +SKIP
    """
    validate_num_tiles(num_tiles)
    layers = list(layers)
    mlps = []
    for index, layer in enumerate(layers):
        mlp = getattr(layer, "mlp", None)
        if not isinstance(mlp, nn.Module):
            children = ", ".join(name for name, _ in layer.named_children())
            raise ValueError(
                f"Decoder layer {index} ({type(layer).__name__}) has no 'mlp' submodule to tile; its children are: "
                f"{children}. Tiled MLP supports layers whose feed-forward block is named 'mlp' (Llama, Qwen, "
                "Mistral, Gemma...); mixture-of-experts blocks are not supported."
            )
        if getattr(mlp.forward, _MARKER, False):
            raise ValueError(f"The MLP of decoder layer {index} is already tiled; apply_tiled_mlp once.")
        mlps.append(mlp)
    return wrap_forwards(mlps, lambda mlp, forward: _tiled(mlp, forward, num_tiles))
