"""The chunked loss equals plain cross-entropy (loss and gradients) and never holds the N x V logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile
from torch.profiler._memory_profiler import Action

from equivalence import assert_equal_up_to_rounding

from lit_memtrain.techniques.loss import chunked_cross_entropy, cross_entropy
from lit_memtrain.datamodules.batch import IGNORE_INDEX

N, H, V = 50, 16, 97
TERMS = N + V + H  # the loss's nested sums: over the tokens, the vocabulary (log-sum-exp), the hidden size


def _inputs(dtype=torch.float32, ignored_fraction=0.3, seed=0, with_bias=True):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=generator).to(dtype).requires_grad_()
    weight = (torch.randn(V, H, generator=generator) / H**0.5).to(dtype).requires_grad_()
    bias = torch.randn(V, generator=generator).to(dtype).requires_grad_() if with_bias else None
    targets = torch.randint(0, V, (N,), generator=generator)
    targets[torch.rand(N, generator=generator) < ignored_fraction] = IGNORE_INDEX
    return hidden, weight, bias, targets


def _grads(loss, *tensors):
    return torch.autograd.grad(loss, [t for t in tensors if t is not None])


def _reference(hidden, weight, bias, targets, softcap=None, scale=1.0):
    logits = F.linear(hidden.float(), weight.float(), None if bias is None else bias.float()) * scale
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX)


@pytest.mark.parametrize("chunk_size", [1, 7, 16, 50, 1000])
def test_chunked_matches_plain_cross_entropy(chunk_size):
    hidden, weight, bias, targets = _inputs()
    expected = _reference(hidden, weight, bias, targets)
    expected_grads = _grads(expected, hidden, weight, bias)
    loss = chunked_cross_entropy(hidden, weight, targets, chunk_size=chunk_size, bias=bias)
    assert loss.dtype == torch.float32
    assert_equal_up_to_rounding(loss, expected, name="loss", terms=TERMS)
    for got, want, name in zip(_grads(loss, hidden, weight, bias), expected_grads, ("hidden", "weight", "bias")):
        assert_equal_up_to_rounding(got, want, name=name, terms=TERMS)


def test_ignored_rows_get_zero_hidden_gradient():
    hidden, weight, _, targets = _inputs(with_bias=False)
    (grad_hidden,) = torch.autograd.grad(chunked_cross_entropy(hidden, weight, targets, chunk_size=8), hidden)
    ignored = targets == IGNORE_INDEX
    assert ignored.any()
    assert torch.all(grad_hidden[ignored] == 0)
    assert torch.all(grad_hidden[~ignored].abs().sum(dim=1) > 0)


def test_plain_cross_entropy_matches_torch():
    hidden, weight, bias, targets = _inputs()
    logits = F.linear(hidden, weight, bias)
    expected = _reference(hidden, weight, bias, targets)
    assert_equal_up_to_rounding(cross_entropy(logits, targets), expected, name="loss", terms=TERMS)


@pytest.mark.parametrize("loss_name", ["chunked", "plain"])
def test_global_num_items_makes_micro_batches_sum_to_full_batch(loss_name):
    hidden, weight, bias, targets = _inputs()

    def loss_fn(h, t, num_items):
        if loss_name == "chunked":
            return chunked_cross_entropy(h, weight, t, num_items=num_items, chunk_size=6, bias=bias)
        return cross_entropy(F.linear(h, weight, bias), t, num_items=num_items)

    total = int((targets != IGNORE_INDEX).sum())
    split = 20
    first = loss_fn(hidden[:split], targets[:split], total)
    second = loss_fn(hidden[split:], targets[split:], torch.tensor(total))
    full = _reference(hidden, weight, bias, targets)
    assert_equal_up_to_rounding(first + second, full, name="loss", terms=TERMS)
    grads = zip(_grads(first + second, hidden, weight, bias), _grads(full, hidden, weight, bias))
    for (got, want), name in zip(grads, ("hidden", "weight", "bias")):
        assert_equal_up_to_rounding(got, want, name=name, terms=TERMS)
    local_count = int((targets[:split] != IGNORE_INDEX).sum())
    assert local_count != total
    local_mean = loss_fn(hidden[:split], targets[:split], None)
    assert_equal_up_to_rounding(local_mean, first * total / local_count, name="local mean", terms=TERMS)


def test_softcap_forward_and_backward():
    hidden, weight, bias, targets = _inputs()
    hidden = (hidden.detach() * 8).requires_grad_()  # large logits, so the cap really bends them
    expected = _reference(hidden, weight, bias, targets, softcap=5.0)
    uncapped = _reference(hidden, weight, bias, targets)
    assert not torch.allclose(expected, uncapped, rtol=1e-2)
    loss = chunked_cross_entropy(hidden, weight, targets, chunk_size=9, softcap=5.0, bias=bias)
    assert_equal_up_to_rounding(loss, expected, name="loss", terms=TERMS)
    grads = zip(_grads(loss, hidden, weight, bias), _grads(expected, hidden, weight, bias))
    for (got, want), name in zip(grads, ("hidden", "weight", "bias")):
        assert_equal_up_to_rounding(got, want, name=name, terms=TERMS)
    plain = cross_entropy(F.linear(hidden, weight, bias), targets, softcap=5.0)
    assert_equal_up_to_rounding(plain, expected, name="plain loss", terms=TERMS)


@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("scale", [4.0, 0.25])
def test_scaled_logits_forward_and_backward(scale, softcap):
    hidden, weight, bias, targets = _inputs()
    hidden = (hidden.detach() * 2).requires_grad_()
    expected = _reference(hidden, weight, bias, targets, softcap=softcap, scale=scale)
    assert not torch.allclose(expected, _reference(hidden, weight, bias, targets, softcap=softcap), rtol=1e-2)
    loss = chunked_cross_entropy(hidden, weight, targets, chunk_size=9, softcap=softcap, bias=bias, scale=scale)
    assert_equal_up_to_rounding(loss, expected, name="loss", terms=TERMS)
    grads = zip(_grads(loss, hidden, weight, bias), _grads(expected, hidden, weight, bias))
    for (got, want), name in zip(grads, ("hidden", "weight", "bias")):
        assert_equal_up_to_rounding(got, want, name=name, terms=TERMS)
    plain = cross_entropy(F.linear(hidden, weight, bias), targets, softcap=softcap, scale=scale)
    assert_equal_up_to_rounding(plain, expected, name="plain loss", terms=TERMS)


@pytest.mark.parametrize("num_items", [None, 0, torch.tensor(0)])
@pytest.mark.parametrize("loss_name", ["chunked", "plain"])
def test_all_ignored_gives_zero_loss_connected_to_graph(loss_name, num_items):
    hidden, weight, bias, targets = _inputs()
    targets = torch.full_like(targets, IGNORE_INDEX)
    if loss_name == "chunked":
        loss = chunked_cross_entropy(hidden, weight, targets, num_items=num_items, bias=bias)
    else:
        loss = cross_entropy(F.linear(hidden, weight, bias), targets, num_items=num_items)
    assert loss.item() == 0.0
    assert loss.requires_grad
    loss.backward()
    for tensor in (hidden, weight, bias):
        assert tensor.grad is not None
        assert torch.all(tensor.grad == 0)


def test_bf16_inputs_close_to_fp32_reference():
    hidden, weight, bias, targets = _inputs()
    expected = _reference(hidden, weight, bias, targets)
    expected_grads = _grads(expected, hidden, weight, bias)
    hidden16, weight16, bias16 = (t.detach().bfloat16().requires_grad_() for t in (hidden, weight, bias))
    loss = chunked_cross_entropy(hidden16, weight16, targets, chunk_size=8, bias=bias16)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, expected, rtol=2e-2, atol=2e-2)
    grads = _grads(loss, hidden16, weight16, bias16)
    assert [g.dtype for g in grads] == [torch.bfloat16] * 3
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got.float(), want, rtol=5e-2, atol=2e-3)


def test_tied_embedding_and_head_accumulate_both_gradients():
    generator = torch.Generator().manual_seed(1)
    embedding = torch.randn(V, H, generator=generator, requires_grad=True)
    mixer = torch.randn(H, H, generator=generator, requires_grad=True)
    input_ids = torch.randint(0, V, (N,), generator=generator)
    targets = torch.roll(input_ids, -1)
    targets[-1] = IGNORE_INDEX

    def loss_with(loss_fn):
        hidden = torch.tanh(F.embedding(input_ids, embedding) @ mixer)
        return loss_fn(hidden)

    expected = loss_with(lambda h: _reference(h, embedding, None, targets))
    loss = loss_with(lambda h: chunked_cross_entropy(h, embedding, targets, chunk_size=11))
    assert_equal_up_to_rounding(loss, expected, name="loss", terms=TERMS + H)  # and the mixer's sum
    grads = zip(_grads(loss, embedding, mixer), _grads(expected, embedding, mixer))
    for (got, want), name in zip(grads, ("embedding", "mixer")):
        assert_equal_up_to_rounding(got, want, name=name, terms=TERMS + H)


def test_frozen_head_gets_no_weight_gradient():
    hidden, weight, _, targets = _inputs(with_bias=False)
    frozen = weight.detach()
    loss = chunked_cross_entropy(hidden, frozen, targets, chunk_size=8)
    (grad_hidden,) = torch.autograd.grad(loss, hidden)
    (expected,) = torch.autograd.grad(_reference(hidden, frozen, None, targets), hidden)
    assert_equal_up_to_rounding(grad_hidden, expected, name="hidden", terms=TERMS)


def test_keeps_no_logits_for_backward():
    hidden, weight, bias, targets = _inputs()
    saved_shapes = []

    def pack(tensor):
        saved_shapes.append(tuple(tensor.shape))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = chunked_cross_entropy(hidden, weight, targets, chunk_size=8, bias=bias)
    node = loss.grad_fn
    while not hasattr(node, "gradients"):  # past the normalisation, to the chunked function's node
        node = node.next_functions[0][0]
    assert saved_shapes == []
    assert [tuple(grad.shape) for grad in node.gradients] == [(N, H), (V, H), (V,)]  # of hidden, weight, bias


def _peak_cpu_bytes(fn) -> int:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        fn()
    live = peak = 0
    for _, action, _, size in prof._memory_profile().timeline:
        if action == Action.CREATE:
            live += size
        elif action == Action.DESTROY:
            live -= size
        peak = max(peak, live)
    return peak


def test_chunked_peak_memory_is_far_below_full_logits():
    rows, vocab, width, chunk = 2048, 4000, 32, 128
    hidden = torch.randn(rows, width, requires_grad=True)
    weight = torch.randn(vocab, width, requires_grad=True)
    targets = torch.randint(0, vocab, (rows,))
    full_logits_bytes = rows * vocab * 4
    plain_peak = _peak_cpu_bytes(lambda: F.cross_entropy(F.linear(hidden, weight), targets).backward())
    chunked_peak = _peak_cpu_bytes(lambda: chunked_cross_entropy(hidden, weight, targets, chunk_size=chunk).backward())
    assert plain_peak >= full_logits_bytes
    assert chunked_peak < full_logits_bytes / 3


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"hidden": torch.zeros(2, 3, 4)}, ValueError, "hidden must be 2-D"),
        ({"weight": torch.zeros(V, H + 1)}, ValueError, "weight must have shape"),
        ({"weight": torch.zeros(V, H, dtype=torch.float64)}, TypeError, "share one floating dtype"),
        ({"targets": torch.zeros(N, dtype=torch.int32)}, TypeError, "targets must be torch.long"),
        ({"targets": torch.zeros(N + 1, dtype=torch.long)}, ValueError, "targets must have shape"),
        ({"bias": torch.zeros(V + 1)}, ValueError, "bias must have shape"),
        ({"chunk_size": 0}, ValueError, "chunk_size must be a positive int"),
        ({"num_items": -1}, ValueError, "num_items must be >= 0"),
        ({"num_items": 2.5}, TypeError, "num_items must be an int"),
        ({"num_items": torch.ones(2)}, ValueError, "num_items must be a scalar tensor"),
        ({"softcap": 0.0}, ValueError, "softcap must be a positive number"),
        ({"scale": -1.0}, ValueError, "scale must be a positive number"),
    ],
)
def test_invalid_arguments_raise_clear_errors(kwargs, error, message):
    arguments = {
        "hidden": torch.zeros(N, H),
        "weight": torch.zeros(V, H),
        "targets": torch.zeros(N, dtype=torch.long),
    } | kwargs
    with pytest.raises(error, match=message):
        chunked_cross_entropy(**arguments)


def test_chunked_matches_plain_under_bf16_autocast():
    torch.manual_seed(0)
    hidden = torch.randn(40, 32, requires_grad=True)
    weight = (torch.randn(300, 32) * 2).requires_grad_()
    targets = torch.randint(0, 300, (40,))
    grads = []
    for chunked in (True, False):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if chunked:
                loss = chunked_cross_entropy(hidden, weight, targets, chunk_size=7)
            else:
                loss = cross_entropy(torch.nn.functional.linear(hidden, weight), targets)
        grads.append(torch.autograd.grad(loss, (hidden, weight)) + (loss.detach(),))
    for got, expected in zip(grads[0], grads[1]):
        assert got.dtype == expected.dtype
        torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-3)


def test_without_grad_the_value_is_the_same_and_no_gradient_is_computed():
    hidden, weight, bias, targets = _inputs()
    chunks = -(-int((targets != IGNORE_INDEX).sum()) // 8)

    def matmuls(grad: bool) -> tuple[int, torch.Tensor]:
        with torch.set_grad_enabled(grad), profile(activities=[ProfilerActivity.CPU]) as prof:
            loss = chunked_cross_entropy(hidden, weight, targets, chunk_size=8, bias=bias)
        return sum(event.name in ("aten::mm", "aten::addmm", "aten::addmm_") for event in prof.events()), loss

    count_with_grad, with_grad = matmuls(True)
    count_without_grad, without_grad = matmuls(False)
    assert_equal_up_to_rounding(without_grad, with_grad.detach(), name="loss", terms=TERMS)
    assert not without_grad.requires_grad
    assert count_without_grad == chunks  # the logits of each chunk, nothing else
    assert count_with_grad == 3 * chunks  # and the gradients of hidden and weight, in forward


def test_a_second_or_double_backward_is_refused():
    hidden, weight, bias, targets = _inputs()
    loss = chunked_cross_entropy(hidden, weight, targets, chunk_size=8, bias=bias)
    (loss * 2).backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="already backpropagated: its gradients are computed once"):
        loss.backward()

    upstream = torch.randn(H, H, requires_grad=True)
    loss = chunked_cross_entropy(hidden.detach() @ upstream, weight, targets, chunk_size=8)
    with pytest.raises(RuntimeError, match="cannot be differentiated twice"):
        torch.autograd.grad(loss, upstream, create_graph=True)
