"""Cross-entropy for causal LMs, plain and chunked.

Why a chunked loss: the logits of a step are tokens x vocabulary, upcast to fp32 for the log-sum-exp. For
Qwen3 (151,936 tokens in the vocabulary) at 160k tokens that is 97 GB, the first thing to run out of memory
as the sequence grows. ``chunked_cross_entropy`` takes the final hidden states and the LM-head weight
instead of logits, and computes the logits of ``chunk_size`` rows at a time, so at most one chunk of
logits exists at any moment. While a chunk's logits exist, their gradients with respect to the hidden
states and the weight are computed too (when autograd will need them), so backward only scales them and
no logits are computed twice.

Rows whose target is ``-100`` are dropped before any logits are computed, so prompt tokens and padding
cost nothing.

Normalisation: both functions return ``sum of token losses / num_items``. ``num_items`` is the number of
trainable tokens of the whole optimizer step (all gradient-accumulation micro-batches, all ranks), so that
micro-batches of different sizes weigh their tokens equally; ``None`` counts the trainable targets passed
in. A count of 0 is treated as 1: a micro-batch whose labels are all ignored gives a loss of exactly 0.0
that is still connected to the graph (zero gradients, no NaN, every rank still runs backward).

:func:`selected_loss_chunks` runs only some of the chunks: the memory planner's hook
(:mod:`lit_memtrain.planner.simulate`), whose fake tensors repeat from the second chunk on, so a few chunks give the
peak of all (a million-token row has 1,024 chunks).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from lit_memtrain.datamodules.batch import IGNORE_INDEX
from lit_memtrain.techniques.autocast import active_autocast_dtype
from lit_memtrain.techniques.bounds_selection import Bounds, BoundsSelection
from lit_memtrain.techniques.lm_head import (
    accumulate_linear_grads,
    chunk_logits,
    linear_output_grad,
    transform_logits,
    validate_logit_transform,
    validate_targets,
)

__all__ = ["chunked_cross_entropy", "chunked_token_losses", "cross_entropy", "selected_loss_chunks"]

_selection = BoundsSelection()


def selected_loss_chunks(select: Callable[[Bounds], Bounds]) -> contextlib.AbstractContextManager[None]:
    """Run only the chunks ``select`` keeps of each chunked loss's ``[start, end)`` row bounds, while the context is
    open.

    For simulating memory on fake tensors (:func:`lit_memtrain.planner.simulate.tiles_simulated_once`): each chunk
    frees what it allocated before the next, and the gradients it adds into exist before the first, so every chunk
    holds what the first holds but a shorter last one: the first and the last give the peak of all. On real tensors the chunks left out are missing from the loss and
    the gradients: never train inside this context.
    """
    return _selection.only(select)


def _chunk_bounds(rows: int, chunk_size: int) -> list[tuple[int, int]]:
    bounds = [(start, min(start + chunk_size, rows)) for start in range(0, rows, chunk_size)]
    return _selection(bounds)


def _validate_num_items(num_items: int | Tensor | None) -> None:
    if num_items is None:
        return
    if isinstance(num_items, Tensor):
        if num_items.numel() != 1:
            raise ValueError(f"num_items must be a scalar tensor, got shape {tuple(num_items.shape)}.")
        return
    if isinstance(num_items, bool) or not isinstance(num_items, int):
        raise TypeError(f"num_items must be an int, a scalar tensor or None, got {type(num_items).__name__}.")
    if num_items < 0:
        raise ValueError(f"num_items must be >= 0 (trainable tokens in the step), got {num_items}.")


def _normalise(loss_sum: Tensor, num_items: int | Tensor | None, local_count: int | Tensor) -> Tensor:
    denominator = local_count if num_items is None else num_items
    if isinstance(denominator, Tensor):
        return loss_sum / denominator.to(device=loss_sum.device, dtype=loss_sum.dtype).clamp(min=1)
    return loss_sum / max(denominator, 1)


def cross_entropy(
    logits: Tensor,
    targets: Tensor,
    num_items: int | Tensor | None = None,
    softcap: float | None = None,
    scale: float = 1.0,
) -> Tensor:
    """Plain cross-entropy over ``logits`` [N, V] (upcast to fp32), summed and divided by ``num_items``.

    Args:
        logits: [N, V] logits, any floating dtype.
        targets: [N] long, ``-100`` for ignored positions.
        num_items: trainable tokens of the whole step; ``None`` counts the non-ignored ``targets``.
        softcap: if set, logits become ``softcap * tanh(logits / softcap)`` first (Gemma-style capping).
        scale: logits are multiplied by it first, before any capping (Cohere's ``logit_scale``, Granite's
            ``1 / logits_scaling``, Falcon-H1's ``lm_head_multiplier``).

    Returns:
        A 0-d fp32 tensor.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be 2-D [N, V], got shape {tuple(logits.shape)}. Flatten batch and sequence.")
    validate_targets(targets, logits.shape[0])
    _validate_num_items(num_items)
    validate_logit_transform(softcap, scale)
    logits = transform_logits(logits.float(), softcap, scale)
    loss_sum = F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")
    return _normalise(loss_sum, num_items, (targets != IGNORE_INDEX).sum())


class _ChunkedCrossEntropySum(torch.autograd.Function):
    """Sum of token losses over the rows ``kept_rows`` of ``hidden``, never holding all logits at once.

    The gradients are computed in forward, a chunk at a time while that chunk's logits exist anyway, and
    backward only scales them: the logits are computed once rather than again in backward, which takes the
    LM head from four matmuls per step to three. Kept until backward: the gradient of ``hidden`` (instead of
    ``hidden`` itself) and those of the weight and bias, in their own dtypes (what a backward that
    recomputes would allocate first thing). Backward scales them in place and hands them over, so the loss
    can be backpropagated once: a second backward (``retain_graph``) or a double backward
    (``create_graph``) raises instead of returning wrong gradients. Several losses computed before one
    backward each keep a weight gradient until then.
    """

    @staticmethod
    def forward(
        ctx,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        kept_rows: Tensor,
        kept_targets: Tensor,
        chunk_size: int,
        softcap: float | None,
        scale: float,
        needs_grad: tuple[bool, bool, bool],
    ) -> Tensor:
        needs_hidden, needs_weight, needs_bias = needs_grad
        grad_hidden = torch.zeros_like(hidden) if needs_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if needs_weight else None
        grad_bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if needs_bias else None
        loss_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start, end in _chunk_bounds(kept_rows.shape[0], chunk_size):
            _add_loss_and_grads_of_chunk(
                loss_sum,
                hidden,
                weight,
                bias,
                kept_rows[start:end],
                kept_targets[start:end],
                softcap,
                scale,
                any(needs_grad),
                (grad_hidden, grad_weight, grad_bias),
            )
        # Held on ctx, not saved for backward: they are results, not inputs, and backward takes them over.
        ctx.gradients = (
            grad_hidden,
            None if grad_weight is None else grad_weight.to(weight.dtype),
            None if grad_bias is None else grad_bias.to(bias.dtype),
        )
        return loss_sum

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        if torch.is_grad_enabled():
            raise RuntimeError(
                "chunked_cross_entropy computes its gradients in forward and cannot be differentiated twice "
                "(create_graph=True); use cross_entropy on full logits for higher-order gradients."
            )
        if ctx.gradients is None:
            raise RuntimeError(
                "chunked_cross_entropy was already backpropagated: its gradients are computed once, in forward, "
                "and handed over to the first backward (retain_graph=True cannot reuse them). Compute the loss again."
            )
        gradients, ctx.gradients = ctx.gradients, None
        scaled = tuple(None if grad is None else grad.mul_(grad_output) for grad in gradients)
        return (*scaled, None, None, None, None, None, None)


def _add_loss_and_grads_of_chunk(
    loss_sum: Tensor,
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    rows: Tensor,
    targets: Tensor,
    softcap: float | None,
    scale: float,
    needs_grad: bool,
    grads: tuple[Tensor | None, Tensor | None, Tensor | None],
) -> None:
    """Add the summed loss of the tokens ``rows`` of ``hidden`` into ``loss_sum``; with ``needs_grad``, their
    gradients into ``grads`` (of hidden, weight, bias).

    A function of its own so that the chunk's logits and their gradient are freed when it returns: the loop's names
    would hold a chunk's ``[tokens, vocab]`` gradient while the next chunk computes its logits.
    """
    grad_hidden, grad_weight, grad_bias = grads
    hidden_rows = hidden.index_select(0, rows)
    logits = chunk_logits(hidden_rows, weight, bias, softcap, scale)
    lse = torch.logsumexp(logits, dim=1)
    loss_sum += (lse - logits.gather(1, targets.unsqueeze(1)).squeeze(1)).sum()
    if not needs_grad:
        return
    grad_logits = torch.exp(logits - lse.unsqueeze(1))
    grad_logits[torch.arange(rows.shape[0], device=rows.device), targets] -= 1
    linear_output_grad(grad_logits, logits, softcap, scale, grad_bias)
    del logits
    grad_logits = grad_logits.to(hidden.dtype)
    accumulate_linear_grads(grad_logits, rows, hidden_rows, weight, grad_hidden, grad_weight)


def chunked_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    num_items: int | Tensor | None = None,
    chunk_size: int = 1024,
    softcap: float | None = None,
    bias: Tensor | None = None,
    scale: float = 1.0,
) -> Tensor:
    """Cross-entropy of ``hidden @ weight.T (+ bias)`` without materialising the [N, V] logits.

    Equal to ``cross_entropy(F.linear(hidden, weight, bias), targets, num_items, softcap, scale)`` in value and
    gradients, with logits computed ``chunk_size`` trainable rows at a time (with their gradients, when
    autograd needs them).

    Args:
        hidden: [N, H] final hidden states (after the final norm), any floating dtype.
        weight: [V, H] LM-head weight, same dtype as ``hidden``. May be tied to the input embedding.
        targets: [N] long, already shifted, ``-100`` for ignored positions.
        num_items: trainable tokens of the whole step (across micro-batches and ranks); ``None`` counts the
            non-ignored ``targets``.
        chunk_size: rows per chunk; peak extra memory is about ``chunk_size * V * 6`` bytes for bf16 inputs.
        softcap: if set, logits become ``softcap * tanh(logits / softcap)``.
        bias: optional [V] LM-head bias, same dtype as ``weight``.
        scale: logits are multiplied by it first, before any capping.

    Returns:
        A 0-d fp32 tensor.

    Example:
        >>> out = model.model(input_ids, use_cache=False)  # doctest: +SKIP
        >>> loss = chunked_cross_entropy(  # doctest: +SKIP
        ...     out.last_hidden_state.flatten(0, 1), model.lm_head.weight, targets.flatten(), num_items=n_tokens
        ... )
    """
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be 2-D [N, H], got shape {tuple(hidden.shape)}. Flatten batch and sequence.")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(
            f"weight must have shape [V, {hidden.shape[1]}] to match hidden [N, H], got {tuple(weight.shape)}."
        )
    autocasting = active_autocast_dtype(hidden.device.type) is not None
    if not hidden.is_floating_point() or (weight.dtype != hidden.dtype and not autocasting):
        raise TypeError(
            f"hidden and weight must share one floating dtype, got hidden {hidden.dtype} and weight {weight.dtype}."
        )
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.dtype != weight.dtype):
        raise ValueError(
            f"bias must have shape [{weight.shape[0]}] and dtype {weight.dtype}, "
            f"got {tuple(bias.shape)} {bias.dtype}."
        )
    validate_targets(targets, hidden.shape[0])
    _validate_num_items(num_items)
    validate_logit_transform(softcap, scale)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}.")
    kept_rows = (targets != IGNORE_INDEX).nonzero().squeeze(1)
    device_type = hidden.device.type
    compute_dtype = active_autocast_dtype(device_type)
    if compute_dtype is not None:
        # Cast once here (differentiably) and run the function with autocast off, so that the logits and
        # their gradients are computed in the autocast dtype, as plain F.linear under autocast would.
        hidden, weight = hidden.to(compute_dtype), weight.to(compute_dtype)
        bias = bias.to(compute_dtype) if bias is not None else None
    grad_enabled = torch.is_grad_enabled()
    needs_grad = tuple(grad_enabled and t is not None and t.requires_grad for t in (hidden, weight, bias))
    autocast_off = torch.autocast(device_type, enabled=False) if compute_dtype else contextlib.nullcontext()
    with autocast_off:
        loss_sum = _ChunkedCrossEntropySum.apply(
            hidden, weight, bias, kept_rows, targets.index_select(0, kept_rows), chunk_size, softcap, scale, needs_grad
        )
    return _normalise(loss_sum, num_items, kept_rows.shape[0])


@torch.no_grad()
def chunked_token_losses(
    hidden: Tensor,
    weight: Tensor | None,
    targets: Tensor,
    chunk_size: int = 1024,
    softcap: float | None = None,
    bias: Tensor | None = None,
    scale: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """Each target's loss and whether the argmax predicts it, without gradients, ``chunk_size`` rows at a time.

    What validation needs per token (the positional-loss diagnostic, token accuracy). ``hidden`` ``[N, H]`` holds
    only the rows to score (their targets are ``targets`` ``[N]``, none ignored); with ``weight=None`` it holds the
    logits themselves (a model's own head, ``loss_type="nll"``).
    """
    losses, correct = [], []
    for start in range(0, hidden.shape[0], chunk_size):
        rows = hidden[start : start + chunk_size]
        logits = transform_logits(rows.float(), softcap, scale) if weight is None else chunk_logits(
            rows, weight, bias, softcap, scale
        )
        chunk_targets = targets[start : start + chunk_size]
        losses.append(F.cross_entropy(logits, chunk_targets, reduction="none"))
        correct.append(logits.argmax(-1) == chunk_targets)
    if not losses:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, empty.bool()
    return torch.cat(losses), torch.cat(correct)
