"""tests/equivalence.py: rounding passes, defects fail, each tensor is held to its own scale."""

from __future__ import annotations

import pytest
import torch
from equivalence import TINY_MODEL_TERMS, assert_each_equal_up_to_rounding, assert_equal_up_to_rounding


def _gradient(scale: float = 1.0) -> torch.Tensor:
    return scale * torch.randn(64, 48, generator=torch.Generator().manual_seed(0))


def test_sums_in_another_order_pass():
    generator = torch.Generator().manual_seed(0)
    inputs, outputs = torch.randn(4096, 64, generator=generator), torch.randn(4096, 32, generator=generator)
    whole = inputs.T @ outputs  # a linear layer's weight gradient over 4096 tokens
    in_chunks = sum(inputs[i : i + 100].T @ outputs[i : i + 100] for i in range(0, 4096, 100))
    assert not torch.equal(in_chunks, whole)
    assert_equal_up_to_rounding(in_chunks, whole, name="chunks", terms=4096)
    exact = (inputs.double().T @ outputs.double()).float()  # the float64 sum rounded once
    assert_equal_up_to_rounding(whole, exact, name="float64 rounded", terms=4096)
    sequential = torch.zeros(32)
    for row in outputs:  # one row after the other: 4095 roundings in a row, each of up to the whole sum's size
        sequential += row
    assert_equal_up_to_rounding(sequential, outputs.double().sum(0).float(), name="sequential", terms=4096)


def test_a_scaled_tensor_or_one_wrong_element_fails():
    expected = _gradient()
    with pytest.raises(AssertionError, match="of 3072 elements over"):
        assert_equal_up_to_rounding(expected * (1 + 1e-3), expected, name="scaled", terms=TINY_MODEL_TERMS)
    perturbed = expected.clone()
    perturbed[3, 5] += 1e-4 * expected.abs().max()
    with pytest.raises(AssertionError, match=r"one: \|actual - expected\| reaches .* at index \(3, 5\) .* 1 of 3072"):
        assert_equal_up_to_rounding(perturbed, expected, name="one", terms=TINY_MODEL_TERMS)


def test_tiny_tensors_are_held_to_their_own_scale():
    expected = _gradient(1e-9)
    torch.testing.assert_close(expected * 1.5, expected, rtol=0, atol=1e-6)  # what a fixed atol let pass
    with pytest.raises(AssertionError, match=r"x scale 4\.1e-09 \(the largest \|expected\|\)"):
        assert_equal_up_to_rounding(expected * (1 + 1e-3), expected, name="tiny", terms=TINY_MODEL_TERMS)
    assert_equal_up_to_rounding((expected.double() * (1 + 1e-7)).float(), expected, name="tiny", terms=1)


def test_a_sum_that_cancels_is_held_to_the_magnitude_of_its_terms():
    terms = torch.tensor([1.0, 1e-7, -1.0], dtype=torch.float64)
    expected, actual = terms.sum().float(), terms.float().sum()  # 1e-7 against 1 + 1e-7 rounded, minus 1
    with pytest.raises(AssertionError):
        assert_equal_up_to_rounding(actual, expected, name="cancelled", terms=3)
    assert_equal_up_to_rounding(actual, expected, name="cancelled", terms=3, scale=1.0)


def test_by_name_each_tensor_has_its_own_scale_and_the_names_must_match():
    expected = {"large": _gradient(), "small": _gradient(1e-6)}
    actual = {"large": expected["large"], "small": expected["small"] + 1e-4 * expected["small"].abs().max()}
    with pytest.raises(AssertionError, match=r"grad\.small: \|actual - expected\|"):
        assert_each_equal_up_to_rounding(actual, expected, name="grad.", terms=TINY_MODEL_TERMS)
    with pytest.raises(AssertionError, match=r"names differ; missing \['small'\], unexpected \[\]"):
        assert_each_equal_up_to_rounding({"large": expected["large"]}, expected, terms=TINY_MODEL_TERMS)
    assert_each_equal_up_to_rounding(dict(expected), expected, terms=TINY_MODEL_TERMS)


def test_numbers_shapes_dtypes_and_non_finite_values():
    assert_equal_up_to_rounding(0.6931471805599453, torch.tensor(0.6931472), name="loss", terms=1)
    assert_equal_up_to_rounding([1.0, float("inf")], [1.0, float("inf")], name="losses", terms=1)
    with pytest.raises(AssertionError, match="non-finite values differ"):
        assert_equal_up_to_rounding([1.0, float("nan")], [1.0, 2.0], name="losses", terms=1)
    with pytest.raises(AssertionError, match=r"shape \(2,\) where \(3,\) was expected"):
        assert_equal_up_to_rounding(torch.zeros(2), torch.zeros(3), name="x", terms=1)
    with pytest.raises(TypeError, match="torch.bfloat16 values: this bound is for fp32"):
        assert_equal_up_to_rounding(torch.zeros(2, dtype=torch.bfloat16), torch.zeros(2), name="x", terms=1)
    float64 = torch.tensor([1.0], dtype=torch.float64)
    with pytest.raises(AssertionError, match="eps 2.22e-16"):  # float64 on both sides: float64's rounding
        assert_equal_up_to_rounding(float64 + 1e-12, float64, name="x", terms=1)
