"""Log-probabilities of target tokens, plain and chunked: what preference losses (DPO) are made of.

Why chunked: like the loss (:mod:`lit_memtrain.techniques.loss`), the log-probability of each completion token needs
the log-sum-exp over the vocabulary, and the ``[tokens, vocab]`` logits are the first memory wall at long
context. :func:`chunked_token_log_probs` takes the final hidden states and the LM-head weight and holds the
logits of ``chunk_size`` rows at a time. Unlike cross-entropy, the gradient of each token's log-probability
is weighted by a factor known only once every sequence's sum is known (DPO's sigmoid of the reward margin),
so gradients cannot be computed in forward: backward recomputes each chunk's logits (one more matmul per
chunk), keeping only the per-row log-sum-exp from forward.

Rows whose target is ``-100`` get log-probability 0 and cost nothing.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from lit_memtrain.datamodules.batch import IGNORE_INDEX
from lit_memtrain.techniques.autocast import active_autocast_dtype
from lit_memtrain.techniques.lm_head import (
    accumulate_linear_grads,
    chunk_logits,
    linear_output_grad,
    transform_logits,
    validate_logit_transform,
    validate_targets,
)

__all__ = ["chunked_token_log_probs", "chunked_token_log_probs_and_entropies", "token_entropies", "token_log_probs"]


def token_log_probs(logits: Tensor, targets: Tensor, softcap: float | None = None, scale: float = 1.0) -> Tensor:
    """``log softmax(logits)[target]`` per row (fp32), 0 where the target is -100.

    Args:
        logits: [N, V] logits, any floating dtype (upcast to fp32).
        targets: [N] long, already shifted, ``-100`` for ignored rows.
        softcap, scale: the model's logit transform (see :func:`lit_memtrain.techniques.loss.cross_entropy`).
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be 2-D [N, V], got shape {tuple(logits.shape)}. Flatten batch and sequence.")
    validate_targets(targets, logits.shape[0])
    validate_logit_transform(softcap, scale)
    logits = transform_logits(logits.float(), softcap, scale)
    keep = targets != IGNORE_INDEX
    picked = logits.gather(1, targets.clamp(min=0).unsqueeze(1)).squeeze(1) - torch.logsumexp(logits, dim=1)
    return picked.masked_fill(~keep, 0.0)


class _ChunkedTokenLogProbs(torch.autograd.Function):
    """Log-probabilities of ``kept_targets`` at rows ``kept_rows`` of ``hidden``, a chunk of logits at a time, and
    (``with_entropy``) the entropy of each of those rows' distributions (empty otherwise). Both are differentiable;
    backward does the entropy's share (``dH/dz = -p (log p + H)``) only when the entropy was used (online RL's
    entropy bonus), so logging it costs no backward work."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, kept_rows, kept_targets, chunk_size, softcap, scale, with_entropy):
        logps, lses, entropies = [], [], []
        for start in range(0, kept_rows.shape[0], chunk_size):
            rows = kept_rows[start : start + chunk_size]
            logits = chunk_logits(hidden.index_select(0, rows), weight, bias, softcap, scale)
            lse = torch.logsumexp(logits, dim=1)
            logps.append(logits.gather(1, kept_targets[start : start + chunk_size].unsqueeze(1)).squeeze(1) - lse)
            lses.append(lse)
            if with_entropy:  # -sum p log p, in place: the chunk's logits are not needed again (backward recomputes)
                probs = logits.sub_(lse.unsqueeze(1)).exp_()
                entropies.append(probs.xlogy_(probs).sum(1).neg_())
        empty = hidden.new_zeros(0, dtype=torch.float32)
        entropy = torch.cat(entropies) if entropies else empty.clone()
        lse = torch.cat(lses) if lses else None
        ctx.save_for_backward(hidden, weight, bias, kept_rows, kept_targets, lse, entropy)
        ctx.chunk_size, ctx.softcap, ctx.scale = chunk_size, softcap, scale
        ctx.set_materialize_grads(False)  # an unused output (the entropy, mostly) gets None: no work for it
        return torch.cat(logps) if logps else empty, entropy

    @staticmethod
    def backward(ctx, grad_logps: Tensor, grad_entropy: Tensor | None):
        hidden, weight, bias, kept_rows, kept_targets, lse, entropy = ctx.saved_tensors
        needs_hidden, needs_weight, needs_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.zeros_like(hidden) if needs_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if needs_weight else None
        grad_bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if needs_bias else None
        size, softcap, scale = ctx.chunk_size, ctx.softcap, ctx.scale
        for start in range(0, kept_rows.shape[0], size):
            rows = kept_rows[start : start + size]
            hidden_rows = hidden.index_select(0, rows)
            logits = chunk_logits(hidden_rows, weight, bias, softcap, scale)
            probs = torch.exp(logits - lse[start : start + size].unsqueeze(1))
            if grad_entropy is not None:  # dH/dz = -p (log p + H); xlogy: 0 where p is 0 (a -inf logit)
                grad_h = grad_entropy[start : start + size].float().unsqueeze(1)
                grad_logits = torch.xlogy(probs, probs).add_(probs * entropy[start : start + size].unsqueeze(1))
                grad_logits.mul_(-grad_h)
            else:
                grad_logits = torch.zeros_like(probs)
            if grad_logps is not None:  # d log p_t / d z = onehot(t) - softmax(z), times each row's gradient
                grad = grad_logps[start : start + size].float()
                grad_logits.sub_(probs.mul_(grad.unsqueeze(1)))
                grad_logits[torch.arange(rows.shape[0], device=rows.device), kept_targets[start : start + size]] += grad
            del probs
            linear_output_grad(grad_logits, logits, softcap, scale, grad_bias)
            del logits
            grad_logits = grad_logits.to(hidden.dtype)
            accumulate_linear_grads(grad_logits, rows, hidden_rows, weight, grad_hidden, grad_weight)
        return (
            grad_hidden,
            None if grad_weight is None else grad_weight.to(weight.dtype),
            None if grad_bias is None else grad_bias.to(bias.dtype),
            None, None, None, None, None, None,
        )


def chunked_token_log_probs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    chunk_size: int = 1024,
    softcap: float | None = None,
    bias: Tensor | None = None,
    scale: float = 1.0,
) -> Tensor:
    """:func:`token_log_probs` of ``hidden @ weight.T (+ bias)`` without materialising the [N, V] logits.

    Equal in value and gradients to ``token_log_probs(F.linear(hidden, weight, bias), targets, softcap, scale)``.

    Args:
        hidden: [N, H] final hidden states (after the final norm).
        weight: [V, H] LM-head weight, same dtype as ``hidden`` (or any dtype under autocast).
        targets: [N] long, already shifted, ``-100`` for ignored rows.
        chunk_size: rows per chunk of logits.
        softcap, bias, scale: as for :func:`lit_memtrain.techniques.loss.chunked_cross_entropy`.

    Returns:
        [N] fp32 log-probabilities, 0 at ignored rows.

    Example:
        >>> hidden = model.model(input_ids, use_cache=False).last_hidden_state.flatten(0, 1)  # doctest: +SKIP
        >>> logps = chunked_token_log_probs(hidden, model.lm_head.weight, targets.flatten())  # doctest: +SKIP
        >>> sequence_logps = logps.view_as(targets).sum(-1)  # doctest: +SKIP
    """
    return _chunked(hidden, weight, targets, chunk_size, softcap, bias, scale, with_entropy=False)[0]


def chunked_token_log_probs_and_entropies(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    chunk_size: int = 1024,
    softcap: float | None = None,
    bias: Tensor | None = None,
    scale: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """:func:`chunked_token_log_probs`, and the entropy (nats) of each kept row's distribution over the vocabulary,
    as :func:`token_entropies` gives it: what online RL logs of the tokens it trains (TRL's ``entropy``) and, with
    an entropy bonus, trains on (its gradient is that of the full logits' entropy). The entropy costs one exp and
    one product-sum over each chunk's logits, in place: no more memory; its backward, only when it is used.

    Returns:
        [N] fp32 log-probabilities and [N] fp32 entropies, both 0 at ignored rows.
    """
    return _chunked(hidden, weight, targets, chunk_size, softcap, bias, scale, with_entropy=True)


def token_entropies(
    logits: Tensor,
    targets: Tensor,
    softcap: float | None = None,
    scale: float = 1.0,
    chunk_size: int = 1024,
    with_grad: bool = False,
) -> Tensor:
    """``-sum softmax(z) log softmax(z)`` per row of the transformed logits ``z`` (fp32), 0 where the target is
    -100: the entropy at the positions :func:`token_log_probs` scores. ``chunk_size`` rows at a time, so that only
    a chunk's fp32 copy of the logits is made; a ``-inf`` logit adds 0, as in the chunked path. Without gradient
    unless ``with_grad`` (an entropy bonus trains on it: each chunk's probabilities are then kept for backward)."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be 2-D [N, V], got shape {tuple(logits.shape)}. Flatten batch and sequence.")
    validate_targets(targets, logits.shape[0])
    validate_logit_transform(softcap, scale)
    entropies = []
    with contextlib.nullcontext() if with_grad else torch.no_grad():
        for rows in logits.split(chunk_size):
            chunk = transform_logits(rows.float(), softcap, scale)
            if with_grad:  # clamped: a -inf logit gives 0 * finite, with a gradient of 0 rather than NaN
                log_probs = torch.log_softmax(chunk, dim=1).clamp(min=torch.finfo(torch.float32).min)
                entropies.append(-(log_probs.exp() * log_probs).sum(1))
                continue
            probs = (chunk - torch.logsumexp(chunk, dim=1, keepdim=True)).exp_()
            entropies.append(probs.xlogy_(probs).sum(1).neg_())
    entropy = torch.cat(entropies) if entropies else logits.new_zeros(0, dtype=torch.float32)
    return entropy.masked_fill(targets == IGNORE_INDEX, 0.0)


def _chunked(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    chunk_size: int,
    softcap: float | None,
    bias: Tensor | None,
    scale: float,
    with_entropy: bool,
) -> tuple[Tensor, Tensor]:
    if hidden.dim() != 2 or weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(
            f"hidden must be [N, H] and weight [V, H], got {tuple(hidden.shape)} and {tuple(weight.shape)}."
        )
    validate_targets(targets, hidden.shape[0])
    validate_logit_transform(softcap, scale)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}.")
    device_type = hidden.device.type
    compute_dtype = active_autocast_dtype(device_type)
    if compute_dtype is not None:  # as F.linear under autocast would: logits in the autocast dtype
        hidden, weight = hidden.to(compute_dtype), weight.to(compute_dtype)
        bias = bias.to(compute_dtype) if bias is not None else None
    elif weight.dtype != hidden.dtype or not hidden.is_floating_point():
        raise TypeError(f"hidden and weight must share one floating dtype, got {hidden.dtype} and {weight.dtype}.")
    kept_rows = (targets != IGNORE_INDEX).nonzero().squeeze(1)
    autocast_off = torch.autocast(device_type, enabled=False) if compute_dtype else contextlib.nullcontext()
    with autocast_off:
        kept, entropy = _ChunkedTokenLogProbs.apply(
            hidden, weight, bias, kept_rows, targets.index_select(0, kept_rows), chunk_size, softcap, scale,
            with_entropy,
        )  # fmt: skip
    logps = kept.new_zeros(targets.shape[0]).index_copy(0, kept_rows, kept)
    if not with_entropy:
        return logps, entropy
    return logps, entropy.new_zeros(targets.shape[0]).index_copy(0, kept_rows, entropy)
