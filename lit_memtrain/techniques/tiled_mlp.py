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

Mixture-of-experts blocks: the experts act on every token independently too, given its routing, so their
module is tiled over the tokens with the expert indices and routing weights as tiled inputs; the router
runs once outside the tiles (the memory is in the experts' intermediates, not in the [T, experts] router
logits), which keeps the load-balancing loss and the router's gradients those of the untiled step.

The random state is replayed in backward (CPU and CUDA generators), so dropout inside the MLP (LoRA's)
draws the same masks when a tile is recomputed. Tiles draw their masks one after another, so they differ
from the masks of an untiled call with the same seed (equally valid, not equal).

Parameter gradients are summed over tiles in the parameters' dtype and returned from the autograd function
(not accumulated into ``.grad`` per tile), so gradient hooks (FSDP2, DDP) fire once per step. The
parameters are collected at each call from ``mlp.parameters()`` (those requiring grad), so LoRA adapters
inside the MLP and FSDP2's unsharded parameters are included.

:func:`selected_tiles` runs only some of the tiles: the memory planner's hook (:mod:`lit_memtrain.planner.simulate`),
whose fake tensors repeat from the second tile on, so a few tiles give the peak of all.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn

from lit_memtrain.techniques.autocast import active_autocast_dtype
from lit_memtrain.models.layers import wrap_forwards
from lit_memtrain.techniques.bounds_selection import Bounds, BoundsSelection

__all__ = ["apply_tiled_mlp", "mlp_tiles", "selected_tiles", "validate_num_tiles"]

_MIN_TILE_TOKENS = 1024
_MARKER = "_lit_memtrain_tiled"
_selection = BoundsSelection()


def mlp_tiles(seq_len: int, hidden_size: int) -> int:
    """Number of sequence tiles for an MLP over ``seq_len`` tokens: ``ceil(seq_len / max(hidden_size, 1024))``."""
    return max(1, math.ceil(seq_len / max(hidden_size, _MIN_TILE_TOKENS)))


def validate_num_tiles(num_tiles: int | None) -> None:
    """Raise ``ValueError`` unless ``num_tiles`` is a positive int or ``None`` (chosen per call)."""
    if num_tiles is not None and (isinstance(num_tiles, bool) or not isinstance(num_tiles, int) or num_tiles < 1):
        raise ValueError(f"num_tiles must be a positive int, or None to choose from the sequence; got {num_tiles!r}.")


def selected_tiles(select: Callable[[Bounds], Bounds]) -> contextlib.AbstractContextManager[None]:
    """Run only the tiles ``select`` keeps of each tiled call's ``[start, end)`` bounds, while the context is open.

    For simulating memory on fake tensors (what :func:`lit_memtrain.planner.simulate.tiles_simulated_once` does):
    from the second tile on each tile holds the same tensors as the second, so the first two and the last give the
    peak of all at a fraction of the operations. On real tensors the tiles left out leave their part of the output
    and of the input's gradient unwritten: never train inside this context.

    Example:
        >>> with selected_tiles(lambda bounds: bounds[:2]):  # doctest: +SKIP
        ...     loss.backward()
    """
    return _selection.only(select)


def _tile_bounds(length: int, num_tiles: int) -> list[tuple[int, int]]:
    num_tiles = min(num_tiles, length)
    size = math.ceil(length / num_tiles)
    bounds = [(start, min(start + size, length)) for start in range(0, length, size)]
    return _selection(bounds)


class _TiledFunction(torch.autograd.Function):
    """``forward(*inputs)`` run over tiles of the inputs' dimension ``dim``, recomputed tile by tile in backward.

    The first ``num_inputs`` tensors are tiled (a dense MLP: the hidden states, tokens on dim -2; an experts
    module: hidden states, expert indices and routing weights, tokens on dim 0); the rest are the parameters.
    """

    @staticmethod
    def forward(
        ctx: Any, forward: Callable[..., Tensor], num_tiles: int, dim: int, num_inputs: int, *tensors: Tensor
    ) -> Tensor:
        inputs, params = tensors[:num_inputs], tensors[num_inputs:]
        length = inputs[0].shape[dim]
        bounds = _tile_bounds(length, num_tiles)
        device = inputs[0].device
        # Dropout inside the MLP (LoRA's) must draw the same masks when backward recomputes the tiles.
        ctx.rng_states = (torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None)
        # Autocast is off inside a custom backward: remember it so the recomputed tiles match forward's dtypes.
        autocast_dtype = active_autocast_dtype(device.type)
        ctx.autocast = (device.type, autocast_dtype) if autocast_dtype is not None else None
        detached = [t.detach() for t in inputs]  # tiles of the inputs themselves would claim requires_grad
        out: Tensor | None = None
        for start, end in bounds:
            tile_out = forward(*(t.narrow(dim, start, end - start) for t in detached))
            if out is None:
                shape = list(tile_out.shape)
                shape[dim] = length
                out = tile_out.new_empty(shape)
            out.narrow(dim, start, end - start).copy_(tile_out)
            del tile_out  # not held while the next tile computes
        ctx.forward, ctx.bounds, ctx.dim, ctx.num_inputs = forward, bounds, dim, num_inputs
        ctx.save_for_backward(*inputs, *params)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        saved = ctx.saved_tensors
        inputs, params = saved[: ctx.num_inputs], saved[ctx.num_inputs :]
        needs = ctx.needs_input_grad[4 : 4 + ctx.num_inputs]
        grad_inputs = [torch.zeros_like(t) if need else None for t, need in zip(inputs, needs)]
        grad_params: list[Tensor | None] = [None] * len(params)
        device = inputs[0].device
        cpu_state, cuda_state = ctx.rng_states
        with torch.random.fork_rng(devices=[device] if cuda_state is not None else []):
            torch.set_rng_state(cpu_state)
            if cuda_state is not None:
                torch.cuda.set_rng_state(cuda_state, device)
            for start, end in ctx.bounds:
                _backward_tile(ctx, inputs, params, needs, grad_out, start, end, grad_inputs, grad_params)
        return None, None, None, None, *grad_inputs, *grad_params


def _backward_tile(
    ctx: Any,
    inputs: tuple[Tensor, ...],
    params: tuple[Tensor, ...],
    needs: tuple[bool, ...],
    grad_out: Tensor,
    start: int,
    end: int,
    grad_inputs: list[Tensor | None],
    grad_params: list[Tensor | None],
) -> None:
    """Recompute the tile ``[start, end)`` with autograd and add its gradients into ``grad_inputs`` (written in
    place) and ``grad_params`` (the first tile's gradients become the sums).

    A function of its own so that the tile's recomputed tensors and gradients are freed when it returns, before the
    next tile: the loop's names would hold them (a tile's parameter gradients: three ``H x I`` matrices) while the
    next tile computes its own.
    """
    dim = ctx.dim
    tiles = [t.narrow(dim, start, end - start).detach().requires_grad_(n) for t, n in zip(inputs, needs)]
    autocast = torch.autocast(*ctx.autocast) if ctx.autocast else contextlib.nullcontext()
    with torch.enable_grad(), autocast:
        tile_out = ctx.forward(*tiles)
    wanted = [tile for tile, need in zip(tiles, needs) if need]
    tile_grad_out = grad_out.narrow(dim, start, end - start)
    grads = torch.autograd.grad(tile_out, [*wanted, *params], tile_grad_out, allow_unused=True)
    input_grads = iter(grads[: len(wanted)])
    for index, need in enumerate(needs):
        grad = next(input_grads) if need else None
        if grad is not None:
            grad_inputs[index].narrow(dim, start, end - start).copy_(grad)
    for index, grad in enumerate(grads[len(wanted) :]):
        if grad is None:
            continue
        if grad_params[index] is None:
            grad_params[index] = grad
        else:
            grad_params[index] += grad


def _trainable(module: nn.Module) -> list[Tensor]:
    return [param for param in module.parameters() if param.requires_grad]


def _tiled(mlp: nn.Module, forward: Callable[[Tensor], Tensor], num_tiles: int | None) -> Callable[[Tensor], Tensor]:
    def tiled_forward(x: Tensor) -> Tensor:
        tiles = num_tiles if num_tiles is not None else mlp_tiles(x.shape[-2], x.shape[-1])
        if min(tiles, x.shape[-2]) <= 1:
            return forward(x)
        return _TiledFunction.apply(forward, tiles, -2, 1, x, *_trainable(mlp))

    setattr(tiled_forward, _MARKER, True)
    return tiled_forward


def _tiled_experts(
    experts: nn.Module, forward: Callable[..., Tensor], num_tiles: int | None
) -> Callable[..., Tensor]:
    """Tile an experts module called as ``experts(hidden [T, H], top_k_index [T, k], top_k_weights [T, k])``.

    The router stays outside (its logits, recorded for the load-balancing loss, keep their graph) and the
    routing weights are a tiled input, so the router gets the gradients of the untiled step.
    """
    signature = inspect.signature(forward)

    def tiled_forward(*args: Any, **kwargs: Any) -> Tensor:
        bound = signature.bind(*args, **kwargs)
        values = list(bound.arguments.values())
        hidden = values[0]
        tiles = num_tiles if num_tiles is not None else mlp_tiles(hidden.shape[0], hidden.shape[-1])
        if len(values) != 3 or hidden.dim() != 2 or min(tiles, hidden.shape[0]) <= 1:
            return forward(*args, **kwargs)
        return _TiledFunction.apply(forward, tiles, 0, 3, *values, *_trainable(experts))

    setattr(tiled_forward, _MARKER, True)
    return tiled_forward


def _experts_of(index: int, layer: nn.Module, mlp: nn.Module) -> nn.Module | None:
    """The experts module of a mixture-of-experts block, ``None`` for a dense MLP; raises for a block whose
    experts cannot be tiled."""
    experts = getattr(mlp, "experts", None)
    if experts is None and getattr(mlp, "router", None) is None:
        return None
    tileable = isinstance(experts, nn.Module) and not isinstance(experts, (nn.ModuleList, nn.ModuleDict))
    if tileable:
        positional = [
            p for p in inspect.signature(experts.forward).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        tileable = len(positional) == 3
    if not tileable:
        raise ValueError(
            f"Decoder layer {index} ({type(layer).__name__}) has a mixture-of-experts 'mlp' ({type(mlp).__name__}) "
            "whose experts TiledMLP cannot tile: it tiles an 'experts' module called as experts(hidden_states, "
            "top_k_index, top_k_weights) (transformers 5 MoE models), not one module per expert. Leave TiledMLP "
            "out for this model."
        )
    return experts


def apply_tiled_mlp(layers: Iterable[nn.Module], num_tiles: int | None = None) -> Callable[[], None]:
    """Run the ``mlp`` of every decoder layer over the sequence in tiles.

    A dense ``mlp`` is tiled whole. In a mixture-of-experts block (an ``mlp`` with an ``experts`` module, as
    transformers 5 builds Qwen3-MoE, Mixtral or GPT-OSS) only the experts are tiled, over the tokens: the
    router runs once, untiled, so its logits keep their graph for the load-balancing loss and the routing
    weights' gradients reach it as in an untiled step. Models mixing dense and sparse layers get both.

    Args:
        layers: decoder layers, each with an ``mlp`` submodule taking [..., L, H] (see
            :func:`lit_memtrain.models.layers.find_decoder_layers`).
        num_tiles: tiles per MLP call; ``None`` picks :func:`mlp_tiles` from each call's L and H.

    Returns:
        A function that restores the MLPs' original ``forward``.

    Raises:
        ValueError: ``num_tiles`` is not a positive int, a layer has no ``mlp`` submodule, a mixture-of-experts
            ``mlp`` has no tileable ``experts`` module (the error names the layer), or an MLP is already tiled.

    Example:
        >>> restore = apply_tiled_mlp(find_decoder_layers(model))  # doctest: +SKIP
    """
    validate_num_tiles(num_tiles)
    layers = list(layers)
    mlps, experts = [], []
    for index, layer in enumerate(layers):
        mlp = getattr(layer, "mlp", None)
        if not isinstance(mlp, nn.Module):
            children = ", ".join(name for name, _ in layer.named_children())
            raise ValueError(
                f"Decoder layer {index} ({type(layer).__name__}) has no 'mlp' submodule to tile; its children are: "
                f"{children}. Tiled MLP supports layers whose feed-forward block is named 'mlp' (Llama, Qwen, "
                "Mistral, Gemma, and the mixture-of-experts Qwen3-MoE, Mixtral, GPT-OSS...)."
            )
        sparse = _experts_of(index, layer, mlp)
        target = mlp if sparse is None else sparse
        if getattr(target.forward, _MARKER, False):
            raise ValueError(f"The MLP of decoder layer {index} is already tiled; apply_tiled_mlp once.")
        (mlps if sparse is None else experts).append(target)
    restore_mlps = wrap_forwards(mlps, lambda mlp, forward: _tiled(mlp, forward, num_tiles))
    restore_experts = wrap_forwards(experts, lambda module, forward: _tiled_experts(module, forward, num_tiles))

    def restore() -> None:
        restore_mlps()
        restore_experts()

    return restore
