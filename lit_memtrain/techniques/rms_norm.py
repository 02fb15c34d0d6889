"""Memory-efficient RMSNorm: fp32 over chunks of tokens, saving only the input and the per-token ``rstd``.

Why: Hugging Face's RMSNorm (Llama, Qwen2/3, Mistral...) casts its input to fp32 and keeps the fp32 copy for
backward, plus the normalised output in the input's dtype for the weight's gradient; its backward then makes
several more fp32 tensors of the input's size. With the logits chunked, the MLP tiled and the layers
checkpointed, these are the largest tensors of a long-context step: in the backward of a recomputed Qwen3-4B
layer at 524,288 tokens per rank, 47 GiB of the 74 GiB peak are fp32 norm intermediates (the input and
post-attention norms over ``L x 2560``, ``q_norm``/``k_norm`` over every head of every token). The norm acts on
each token independently, so it can run over chunks of tokens: forward computes each chunk in fp32 and writes
its output, backward recomputes the chunk's fp32 values from the saved input and ``rstd``. Nothing fp32 of the
whole sequence remains but ``rstd`` (4 bytes a token per norm).

Numerics: the forward is the module's own sequence of operations on each chunk (cast to fp32, ``pow(2)``,
``mean``, ``+ eps``, ``rsqrt``, multiply, cast back, multiply by the weight), so its output is the module's,
bit for bit where the kernels reduce a row the same way whatever the number of rows (the CPU's; a GPU kernel
may pick another reduction order for another shape: fp32 rounding of the mean). The backward is the chain rule
autograd applies to those operations, in fp32; the weight's gradient is summed over chunks in fp32 (autograd
sums it in the gradient's dtype), within the gradient dtype's rounding of autograd's.
:func:`apply_chunked_rms_norm` replaces only norms it can prove compute this: a ``variance_epsilon`` float,
a 1-D ``weight``, and a probe comparing the module's own output with the chunked one on a few tokens, for equality,
in every precision the run computes it in (mixed precision's half inputs with an fp32 weight included; every
precision when the run is not known). Others (Gemma's ``1 + weight``; a weight applied in fp32, under half-precision
inputs) are left as they are and named.

Two hooks serve the memory planner (:mod:`lit_memtrain.planner.simulate`), which runs this code on fake tensors:
:func:`selected_chunks` runs only some chunks (each frees its temporaries before the next, so a few give the peak
of all), and :func:`probed_with` replaces the probe (it compares values, which fake tensors have none of).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from lit_memtrain.models.layers import wrap_forwards
from lit_memtrain.techniques.bounds_selection import Bounds, BoundsSelection

__all__ = [
    "DEFAULT_CHUNK_ELEMENTS",
    "apply_chunked_rms_norm",
    "chunked_rms_norm",
    "probe_rms_norm",
    "probed_with",
    "run_dtypes",
    "selected_chunks",
    "validate_chunk_elements",
]

DEFAULT_CHUNK_ELEMENTS = 2**24  # 64 MiB per fp32 temporary: thousands of tokens per chunk, few kernel launches
_MARKER = "_lit_memtrain_chunked_rms_norm"
_PROBE_TOKENS = 8
_selection = BoundsSelection()


def selected_chunks(select: Callable[[Bounds], Bounds]) -> contextlib.AbstractContextManager[None]:
    """Run only the chunks ``select`` keeps of each chunked norm's ``[start, end)`` row bounds (forward and backward),
    while the context is open.

    For simulating memory on fake tensors (what :func:`lit_memtrain.planner.simulate.tiles_simulated_once` does):
    each chunk frees its temporaries before the next, and the output, ``rstd`` and the gradients exist before the
    first, so every chunk holds what the first holds but a shorter last one: the first and the last give the peak of
    all. On real tensors the chunks left out leave
    their rows of the output and of the gradients unwritten: never train inside this context.
    """
    return _selection.only(select)


def _chunk_bounds(rows: int, rows_per_chunk: int) -> list[tuple[int, int]]:
    bounds = [(start, min(start + rows_per_chunk, rows)) for start in range(0, rows, rows_per_chunk)]
    return _selection(bounds)


class _ChunkedRMSNorm(torch.autograd.Function):
    """``weight * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype)`` over chunks of rows of ``x``."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, eps: float, chunk_elements: int) -> Tensor:
        shape, hidden = x.shape, x.shape[-1]
        rows = x.detach().reshape(-1, hidden)
        rows_per_chunk = max(1, chunk_elements // hidden)
        rstd = torch.empty(rows.shape[0], 1, dtype=torch.float32, device=x.device)
        # The dtype of `weight * normed.to(x.dtype)`; made before the first chunk, so every chunk runs alike.
        out = torch.empty(rows.shape[0], hidden, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
        weight_values = weight.detach()
        for start, end in _chunk_bounds(rows.shape[0], rows_per_chunk):
            _forward_chunk(rows[start:end], weight_values, eps, out[start:end], rstd[start:end])
        ctx.save_for_backward(x, weight, rstd)
        ctx.rows_per_chunk = rows_per_chunk
        return out.view(shape)

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        x, weight, rstd = ctx.saved_tensors
        hidden = x.shape[-1]
        rows, grads = x.reshape(-1, hidden), grad_out.reshape(-1, hidden)
        grad_x = torch.empty_like(rows) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(hidden, dtype=torch.float32, device=x.device) if ctx.needs_input_grad[1] else None
        for start, end in _chunk_bounds(rows.shape[0], ctx.rows_per_chunk):
            _backward_chunk(
                rows[start:end],
                grads[start:end],
                weight,
                rstd[start:end],
                grad_weight,
                None if grad_x is None else grad_x[start:end],
            )
        grad_x_out = grad_x.view(x.shape) if grad_x is not None else None
        return grad_x_out, grad_weight.to(weight.dtype) if grad_weight is not None else None, None, None


# One chunk a call: its fp32 temporaries are freed when the call returns, not held by a loop's names while the next
# chunk makes its own. So every chunk but a shorter last one holds the same tensors (what the planner relies on).


def _forward_chunk(rows: Tensor, weight: Tensor, eps: float, out: Tensor, rstd: Tensor) -> None:
    """Write the norm of ``rows`` into ``out`` and their ``rsqrt(mean(x^2) + eps)`` into ``rstd``."""
    chunk = rows.to(torch.float32)
    chunk_rstd = torch.rsqrt(chunk.pow(2).mean(-1, keepdim=True) + eps)
    out.copy_(weight * (chunk * chunk_rstd).to(rows.dtype))
    rstd.copy_(chunk_rstd)


def _backward_chunk(
    rows: Tensor, grad: Tensor, weight: Tensor, rstd: Tensor, grad_weight: Tensor | None, grad_x: Tensor | None
) -> None:
    """Add the weight's gradient over ``rows`` into ``grad_weight`` (fp32) and write their gradient into ``grad_x``."""
    chunk = rows.to(torch.float32)
    normed = chunk * rstd
    if grad_weight is not None:
        grad_weight += (grad.to(torch.float32) * normed.to(rows.dtype).to(torch.float32)).sum(0)
    if grad_x is not None:
        # autograd's chain through `weight * normed.to(dtype)`: the product in the gradient's dtype, cast to the
        # input's dtype, then to fp32; then through `chunk * rstd` and rstd = rsqrt(mean(x^2) + eps).
        grad_normed = (grad * weight).to(rows.dtype).to(torch.float32)
        grad_rstd = (grad_normed * chunk).sum(-1, keepdim=True)
        grad_mean_square = grad_rstd * -0.5 * rstd.pow(3) / rows.shape[-1]
        grad_x.copy_(grad_normed * rstd + grad_mean_square * 2.0 * chunk)


def chunked_rms_norm(x: Tensor, weight: Tensor, eps: float, chunk_elements: int = DEFAULT_CHUNK_ELEMENTS) -> Tensor:
    """Hugging Face's RMSNorm of ``x`` over its last dimension, in chunks of about ``chunk_elements`` elements.

    Example:
        >>> y = chunked_rms_norm(hidden_states, norm.weight, norm.variance_epsilon)  # doctest: +SKIP
    """
    return _ChunkedRMSNorm.apply(x, weight, eps, chunk_elements)


def probe_rms_norm(norm: nn.Module, dtypes: Collection[torch.dtype] | None = None) -> str | None:
    """Why ``norm`` cannot be replaced by :func:`chunked_rms_norm`, or ``None`` when it computes the same.

    Runs the module's own forward and the chunked one on a few tokens with a known weight, on the CPU, without
    gradients, and requires equal outputs (values and dtype) in every precision the run computes it in. A norm
    that applies its weight in fp32 before casting back (OLMo 2's, GPT-OSS's) computes the same as the chunked one
    on fp32 inputs only: refused for a run that gives it half-precision inputs, accepted for one that does not.

    Args:
        norm: the module.
        dtypes: the dtypes the run computes in besides fp32 and the weight's own: autocast's under mixed precision,
            the parameters' under a sharding that casts them (:func:`run_dtypes`). Checked: inputs in fp32, the
            weight's dtype or any of these, with a weight in its dtype or any of these (``bf16-mixed`` keeps the
            weights fp32 and makes some norms' inputs bf16: the ``q_norm`` after a bf16 projection). ``None``, for a
            caller that does not know the run: fp32, the weight's dtype, bf16 and fp16 (weights and inputs), and
            bf16 and fp16 inputs with an fp32 weight.
    """
    eps, weight = getattr(norm, "variance_epsilon", None), getattr(norm, "weight", None)
    if not isinstance(eps, float) or not isinstance(weight, Tensor) or weight.dim() != 1:
        return "it has no float 'variance_epsilon' and 1-D 'weight'"
    hidden = weight.shape[0]
    generator = torch.Generator().manual_seed(0)
    probe_weight = 1.0 + 0.5 * torch.randn(hidden, generator=generator)
    x = 3.0 * torch.randn(2, _PROBE_TOKENS, hidden, generator=generator)
    if not weight.dtype.is_floating_point:
        return f"its weight is {weight.dtype}"
    for x_dtype, w_dtype in _cases(weight.dtype, dtypes):
        probe_w, probe_x = probe_weight.to(w_dtype), x.to(x_dtype)
        with torch.no_grad():
            expected = torch.func.functional_call(norm, {"weight": probe_w}, (probe_x,), strict=False)
            found = chunked_rms_norm(probe_x, probe_w, eps, chunk_elements=hidden * 3)
        if not isinstance(expected, Tensor) or expected.dtype != found.dtype or not torch.equal(expected, found):
            where = f"in {x_dtype}" if x_dtype == w_dtype else f"on {x_dtype} inputs with a {w_dtype} weight"
            return f"its output differs from weight * (x.float() * rsqrt(mean(x^2) + eps)).to(x.dtype) {where}"
    return None


_HALF = (torch.bfloat16, torch.float16)


def _cases(weight_dtype: torch.dtype, dtypes: Collection[torch.dtype] | None) -> list[tuple[torch.dtype, torch.dtype]]:
    """The (input, weight) dtypes :func:`probe_rms_norm` compares in."""
    if dtypes is None:
        mixed = [(dtype, torch.float32) for dtype in _HALF]
        same = [(torch.float32, torch.float32), (weight_dtype, weight_dtype), *((dtype, dtype) for dtype in _HALF)]
        return list(dict.fromkeys([same[0], *mixed, *same[1:]]))
    weights = list(dict.fromkeys([weight_dtype, *dtypes]))
    inputs = list(dict.fromkeys([torch.float32, *weights]))
    return [(x_dtype, w_dtype) for x_dtype in inputs for w_dtype in weights]


def run_dtypes(precision: str | None, parameter_dtype: torch.dtype | None = None) -> frozenset[torch.dtype] | None:
    """The dtypes a run computes in besides fp32 and its weights' own, for :func:`probe_rms_norm`.

    Args:
        precision: Lightning's precision name (``trainer.precision``: ``"32-true"``, ``"bf16-mixed"``,
            ``"16-mixed"``, ``"bf16-true"``...): ``-mixed`` adds autocast's dtype (``-true`` converts the weights,
            whose dtype the probe reads from the norm). ``None`` or a name not known here (a plugin's own):
            ``None``, every precision.
        parameter_dtype: the dtype a sharding gathers the parameters in for compute (FSDP2's
            ``MixedPrecisionPolicy.param_dtype``), if any.
    """
    known = {"64-true": (), "32-true": (), "bf16-true": (), "16-true": (), "bf16-mixed": (torch.bfloat16,),
             "16-mixed": (torch.float16,)}  # fmt: skip
    if precision not in known:
        return None
    return frozenset([*known[precision], *([parameter_dtype] if parameter_dtype is not None else [])])


_Probe = Callable[[nn.Module, Collection[torch.dtype] | None], str | None]
_probe: _Probe = probe_rms_norm


@contextlib.contextmanager
def probed_with(probe: _Probe) -> Iterator[None]:
    """Have :func:`apply_chunked_rms_norm` ask ``probe`` (with :func:`probe_rms_norm`'s contract: the norm and the
    run's dtypes in, why the norm cannot be replaced, or ``None``, out) instead of :func:`probe_rms_norm`, while the
    context is open.

    For the memory planner, whose model has fake weights: its probe runs :func:`probe_rms_norm` on real tensors, so a
    plan replaces the same norms as the run.
    """
    global _probe
    previous, _probe = _probe, probe
    try:
        yield
    finally:
        _probe = previous


def apply_chunked_rms_norm(
    modules: Iterable[nn.Module],
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
    dtypes: Collection[torch.dtype] | None = None,
) -> tuple[Callable[[], None], dict[str, str]]:
    """Run every RMSNorm among ``modules`` (classes named ``*RMSNorm``) through :func:`chunked_rms_norm`.

    Each class is probed once (:func:`probe_rms_norm`, or the probe :func:`probed_with` gives) in the run's
    ``dtypes`` (:func:`run_dtypes`; ``None``: every precision); norms of a class the probe cannot prove equal keep
    their own forward.

    Returns:
        A function that restores the original forwards, and the classes left as they are with the reason.

    Raises:
        ValueError: ``chunk_elements`` is not a positive int, or a norm is already chunked.

    Example:
        >>> restore, skipped = apply_chunked_rms_norm(model.modules())  # doctest: +SKIP
    """
    validate_chunk_elements(chunk_elements)
    verdicts: dict[type, str | None] = {}
    norms = []
    for module in modules:
        kind = type(module)
        if not kind.__name__.endswith("RMSNorm"):
            continue
        if getattr(module.forward, _MARKER, False):
            raise ValueError(f"{kind.__name__} is already chunked; apply_chunked_rms_norm once.")
        if kind not in verdicts:
            verdicts[kind] = _probe(module, dtypes)
        if verdicts[kind] is None:
            norms.append(module)
    restore = wrap_forwards(norms, lambda norm, forward: _chunked_forward(norm, chunk_elements))
    return restore, {kind.__name__: reason for kind, reason in verdicts.items() if reason is not None}


def validate_chunk_elements(chunk_elements: int) -> None:
    """Raise ``ValueError`` unless ``chunk_elements`` is a positive int."""
    if isinstance(chunk_elements, bool) or not isinstance(chunk_elements, int) or chunk_elements < 1:
        raise ValueError(f"chunk_elements must be a positive int (elements per fp32 chunk), got {chunk_elements!r}.")


def _chunked_forward(norm: nn.Module, chunk_elements: int) -> Callable[[Tensor], Tensor]:
    def forward(hidden_states: Tensor) -> Tensor:
        return chunked_rms_norm(hidden_states, norm.weight, norm.variance_epsilon, chunk_elements)

    setattr(forward, _MARKER, True)
    return forward

