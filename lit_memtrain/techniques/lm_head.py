"""The LM head a chunk of rows at a time, forward and backward: what the chunked loss and log-probabilities share.

Why one file: :func:`~lit_memtrain.techniques.loss.chunked_cross_entropy` and
:func:`~lit_memtrain.techniques.logprobs.chunked_token_log_probs` both compute ``transform(hidden @ weight.T +
bias)`` for some rows without the ``[tokens, vocab]`` logits, and both differentiate it by hand (the first in
forward, the second in backward). Written once here, the two cannot drift apart: the same logit transform
(scale, then Gemma-style soft-capping), the same derivative of it, the same accumulation of the hidden, weight and
bias gradients, and the same checks of the arguments they both take.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "accumulate_linear_grads",
    "chunk_logits",
    "linear_output_grad",
    "transform_logits",
    "validate_logit_transform",
    "validate_targets",
]


def validate_logit_transform(softcap: float | None, scale: float) -> None:
    """Raise a ValueError unless ``softcap`` is None or positive and ``scale`` is a positive number."""
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be a positive number or None, got {softcap}.")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
        raise ValueError(f"scale must be a positive number, got {scale!r}.")


def validate_targets(targets: Tensor, rows: int) -> None:
    """Raise unless ``targets`` is a ``[rows]`` long tensor: one target per row of flattened logits or hidden
    states."""
    if targets.dim() != 1 or targets.shape[0] != rows:
        raise ValueError(
            f"targets must have shape [{rows}] (one per row), got {tuple(targets.shape)}. "
            "Flatten batch and sequence dimensions first."
        )
    if targets.dtype != torch.long:
        raise TypeError(f"targets must be torch.long, got {targets.dtype}.")


def transform_logits(logits: Tensor, softcap: float | None = None, scale: float = 1.0) -> Tensor:
    """What a model does to its LM head's output: ``softcap * tanh(scale * logits / softcap)``, or
    ``scale * logits`` without a cap."""
    if scale != 1:
        logits = logits * scale
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return logits


def chunk_logits(
    hidden_rows: Tensor, weight: Tensor, bias: Tensor | None, softcap: float | None, scale: float
) -> Tensor:
    """fp32 logits of some rows, scaled and capped."""
    return transform_logits(F.linear(hidden_rows, weight, bias).float(), softcap, scale)


def linear_output_grad(
    grad_logits: Tensor, logits: Tensor, softcap: float | None, scale: float, grad_bias: Tensor | None
) -> None:
    """Turn the fp32 gradient w.r.t. :func:`chunk_logits`' capped, scaled logits into the gradient w.r.t. the
    linear output, in place, and add its column sums to ``grad_bias`` (None: not needed)."""
    if softcap is not None:
        # d(softcap * tanh(z / softcap)) / dz = 1 - tanh^2, with tanh = capped / softcap.
        grad_logits *= 1 - (logits / softcap).square()
    if scale != 1:
        grad_logits *= scale
    if grad_bias is not None:
        grad_bias += grad_logits.sum(dim=0)


def accumulate_linear_grads(
    grad_out: Tensor,
    rows: Tensor,
    hidden_rows: Tensor,
    weight: Tensor,
    grad_hidden: Tensor | None,
    grad_weight: Tensor | None,
) -> None:
    """Add one chunk's gradients of ``hidden @ weight.T`` to the accumulators (None: not needed), given the
    gradient ``grad_out`` w.r.t. that chunk's linear output in the dtype of ``hidden_rows``. An fp32 weight
    gradient accumulates in place (``addmm_``): no [V, H] temporary per chunk."""
    if grad_hidden is not None:
        grad_hidden.index_copy_(0, rows, grad_out @ weight)
    if grad_weight is not None:
        if hidden_rows.dtype == torch.float32:
            grad_weight.addmm_(grad_out.t(), hidden_rows)
        else:
            grad_weight += grad_out.t() @ hidden_rows
