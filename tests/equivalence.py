"""Equal up to rounding: the one assertion for "equals TRL", "equals one process", "equals the model's own".

Two computations of the same numbers that sum in a different order (chunks against the whole, a packed row
against documents run alone, two ranks against one process, our loss against TRL's) differ by rounding, and by
nothing else when the code is right. How much rounding, follows from how the sums are done, not from a figure
that happened to pass on one machine:

* Each fp32 addition rounds to within half a unit in the last place of its result, ``eps/2`` relative to the
  magnitude of what is being summed (``eps = 2**-23``, ``torch.finfo(torch.float32).eps``). A sum of ``n``
  terms of magnitude up to ``S`` reordered carries an error of the order ``eps * sqrt(n) * S``: the roundings are
  of either sign, so they add up like a random walk (the worst case, ``n * eps * S``, needs every rounding to go
  the same way and is not what reordering does).
* The error is relative to the magnitude of the terms summed, not to the result: a gradient that is the small
  sum of large terms of both signs keeps the error of its terms. The tensor's largest value stands for that
  magnitude (an element of a gradient sums the same kind of terms as its largest element), so the bound is one
  figure for the whole tensor, never relative to each element, and never an absolute figure either: a tensor
  whose values are about 1e-9 is held to 1e-9's rounding. Give ``scale`` when the terms are known to be larger
  than the tensor's largest value (a sum that cancels as a whole).
* Nested sums (the logits' sum over the hidden size feeding the loss's sum over the vocabulary and the tokens,
  each layer's sums feeding the next) add their errors in quadrature: ``terms`` is the total length of the
  nested sums a compared value went through, the sum of their lengths. :data:`TINY_MODEL_TERMS` is that figure
  for the tests' tiny models, forward and backward.
* ``FACTOR`` covers the rest: both sides round (a factor ``sqrt(2)``), the largest of many elements lies in the
  tail of the distribution (about 4 standard deviations for thousands of elements) and a rounding step is
  ``eps`` where its value is just below a power of two.

So the bound is ``FACTOR * eps * sqrt(terms) * scale``. With the tiny models' terms it is 1.5e-5 of the
tensor's largest value: a gradient off by a factor (1 + 1e-3), or one element off by 1e-4 of the largest, still
fails (tests/test_equivalence_helper.py). Float64 on both sides is held to float64's ``eps``; anything else
(bf16) has its own rounding and its own tolerance, and is refused here.

Set ``LIT_MEMTRAIN_TOLERANCE_LOG`` to a file to have every comparison append ``worst/allowed`` (the share of the
bound it used), the tensor's name and the test, e.g. to see how close a machine comes to the bounds::

    LIT_MEMTRAIN_TOLERANCE_LOG=shares.tsv pytest -q tests/objectives && sort -gr shares.tsv | head
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

import torch

FACTOR = 4.0
TINY_MODEL_TERMS = 1024
"""The nested sums of a tiny preset's loss and gradients (tests build 2 layers, hidden 64, MLP up to 160, vocab up
to 512, up to about 64 tokens): vocab 512 + tokens 64 + 2 layers x (hidden 64 + MLP 160 + tokens 64) = 1152,
taken as 1024 (the bound grows as its square root: 32)."""

_ROUNDING_LOG = "LIT_MEMTRAIN_TOLERANCE_LOG"


def assert_equal_up_to_rounding(
    actual: torch.Tensor | float,
    expected: torch.Tensor | float,
    *,
    name: str,
    terms: int,
    scale: float | None = None,
    computed_in: torch.dtype | None = None,
) -> None:
    """Assert ``actual`` equals ``expected`` within what reordered fp32 sums can explain (see the module's docstring).

    ``terms``: the total length of the nested sums each value went through (:data:`TINY_MODEL_TERMS` for a tiny
    model's loss, logits or gradients). ``scale``: the magnitude of what was summed, when it is larger than
    ``expected``'s largest value (a weight update ``w - (w - lr * g)`` rounds at the weights' magnitude). Python
    numbers are taken as fp32 results (a logged ``.item()``). ``computed_in``: the precision the values were
    computed in, when it is not what their dtype says (float64 tensors that carry fp32 logits' rounding; numbers
    from a float64 computation).
    """
    (got, got_float64), (want, want_float64) = _values(actual), _values(expected)
    if computed_in is None:
        computed_in = torch.float64 if got_float64 and want_float64 else torch.float32
    eps = torch.finfo(computed_in).eps
    if got.shape != want.shape:
        raise AssertionError(f"{name}: shape {tuple(got.shape)} where {tuple(want.shape)} was expected")
    finite = torch.isfinite(want)
    if not torch.equal(torch.isfinite(got), finite) or not torch.equal(got[~finite], want[~finite]):
        raise AssertionError(f"{name}: non-finite values differ:\nactual {got}\nexpected {want}")
    got, want = got.where(finite, 0.0), want.where(finite, 0.0)
    largest = float(want.abs().max()) if want.numel() else 0.0
    if scale is None or scale <= largest:
        scale, derived = largest, "the largest |expected|"
    else:
        derived = "the magnitude of what was summed, given"
    allowed = FACTOR * eps * math.sqrt(terms) * scale
    difference = (got - want).abs()
    worst = float(difference.max()) if difference.numel() else 0.0
    _record(worst, allowed, name)
    if worst > allowed:
        index = tuple(int(i) for i in torch.unravel_index(difference.argmax(), difference.shape))
        raise AssertionError(
            f"{name}: |actual - expected| reaches {worst:.3g} at index {index} (actual {float(got[index]):.9g}, "
            f"expected {float(want[index]):.9g}), {int((difference > allowed).sum())} of {difference.numel()} "
            f"elements over the {allowed:.3g} rounding allows: {FACTOR:g} x eps {eps:.3g} x sqrt(terms {terms}) "
            f"x scale {scale:.3g} ({derived})"
        )


def assert_each_equal_up_to_rounding(
    actual: Mapping[str, torch.Tensor],
    expected: Mapping[str, torch.Tensor],
    *,
    terms: int,
    name: str = "",
    scale: float | Mapping[str, float] | None = None,
    computed_in: torch.dtype | None = None,
) -> None:
    """:func:`assert_equal_up_to_rounding` for each tensor by name (gradients, weights), after the same names;
    each tensor is held to its own scale (``scale``: one for all, or one by name). ``name`` prefixes the names in
    messages."""
    if actual.keys() != expected.keys():
        missing, extra = sorted(expected.keys() - actual.keys()), sorted(actual.keys() - expected.keys())
        raise AssertionError(f"{name or 'tensors'}: names differ; missing {missing}, unexpected {extra}")
    for key, value in expected.items():
        summed = scale[key] if isinstance(scale, Mapping) else scale
        assert_equal_up_to_rounding(
            actual[key], value, name=f"{name}{key}", terms=terms, scale=summed, computed_in=computed_in
        )


def _values(value: torch.Tensor | float) -> tuple[torch.Tensor, bool]:
    """The values in float64 on the CPU, and whether they were computed in float64 (numbers: fp32 results)."""
    if not isinstance(value, torch.Tensor):
        return torch.tensor(value, dtype=torch.float64), False
    if value.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"{value.dtype} values: this bound is for fp32 (or float64) computations")
    return value.detach().cpu().double(), value.dtype == torch.float64


def _record(worst: float, allowed: float, name: str) -> None:
    path = os.environ.get(_ROUNDING_LOG)
    if path:
        share = worst / allowed if allowed else (0.0 if worst == 0 else math.inf)
        test = os.environ.get("PYTEST_CURRENT_TEST", "").removesuffix(" (call)")
        with open(path, "a") as log:
            log.write(f"{share:.4g}\t{name}\t{test}\n")
