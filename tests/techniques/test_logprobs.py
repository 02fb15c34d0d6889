"""Chunked token log-probabilities equal the plain ones computed from full logits, in value and gradients; the
entropies measured beside them equal those of the full logits and change neither."""

import pytest
import torch
import torch.nn.functional as F
from equivalence import assert_equal_up_to_rounding

from lit_memtrain.techniques.logprobs import (
    chunked_token_log_probs,
    chunked_token_log_probs_and_entropies,
    token_entropies,
    token_log_probs,
)

TERMS = 37 + 50 + 16  # the nested sums at _inputs' sizes: over the rows, the vocabulary (log-sum-exp), hidden


def _inputs(bias: bool, rows: int = 37, hidden: int = 16, vocab: int = 50):
    torch.manual_seed(0)
    h = torch.randn(rows, hidden, requires_grad=True)
    w = (torch.randn(vocab, hidden) * 0.3).requires_grad_()
    b = torch.randn(vocab, requires_grad=True) if bias else None
    targets = torch.randint(0, vocab, (rows,))
    targets[::3] = -100
    return h, w, b, targets


@pytest.mark.parametrize("chunk_size", [1, 5, 1024])
@pytest.mark.parametrize(("softcap", "scale", "bias"), [(None, 1.0, False), (3.0, 0.5, True), (None, 2.0, True)])
def test_chunked_log_probs_equal_plain_ones_with_gradients(chunk_size, softcap, scale, bias):
    h, w, b, targets = _inputs(bias)
    weights = torch.randn(h.shape[0])  # any downstream use: a weighted sum of log-probs
    plain = token_log_probs(F.linear(h, w, b), targets, softcap, scale)
    (plain * weights).sum().backward()
    expected = [t.grad.clone() for t in (h, w, b) if t is not None]
    for t in (h, w, b):
        if t is not None:
            t.grad = None
    chunked = chunked_token_log_probs(h, w, targets, chunk_size, softcap, b, scale)
    (chunked * weights).sum().backward()
    assert_equal_up_to_rounding(chunked, plain, name="log-probs", terms=TERMS)
    for got, want, name in zip([t.grad for t in (h, w, b) if t is not None], expected, ("h", "w", "b")):
        assert_equal_up_to_rounding(got, want, name=name, terms=TERMS)
    assert (chunked[targets == -100] == 0).all()


@pytest.mark.parametrize("chunk_size", [1, 5, 1024])
@pytest.mark.parametrize(("softcap", "scale", "bias"), [(None, 1.0, False), (3.0, 0.5, True), (None, 1 / 0.7, True)])
def test_chunked_entropies_equal_those_of_the_full_logits_and_leave_the_log_probs_and_gradients_alone(
    chunk_size, softcap, scale, bias
):
    h, w, b, targets = _inputs(bias)
    weights = torch.randn(h.shape[0])
    alone = chunked_token_log_probs(h, w, targets, chunk_size, softcap, b, scale)
    expected = torch.autograd.grad((alone * weights).sum(), [t for t in (h, w, b) if t is not None])
    logps, entropies = chunked_token_log_probs_and_entropies(h, w, targets, chunk_size, softcap, b, scale)
    grads = torch.autograd.grad((logps * weights).sum(), [t for t in (h, w, b) if t is not None])
    assert torch.equal(logps, alone) and all(torch.equal(g, e) for g, e in zip(grads, expected))
    plain = token_entropies(F.linear(h, w, b), targets, softcap, scale)
    assert_equal_up_to_rounding(entropies, plain, name="entropies", terms=TERMS)
    scaled = F.linear(h, w, b) * scale
    transformed = scaled if softcap is None else torch.tanh(scaled / softcap) * softcap
    by_definition = torch.distributions.Categorical(logits=transformed).entropy().detach()
    kept = targets != -100
    assert_equal_up_to_rounding(entropies[kept], by_definition[kept], name="entropies", terms=TERMS)
    assert (entropies[~kept] == 0).all()


def test_a_token_the_logits_rule_out_adds_no_entropy_on_either_path():
    """A ``-inf`` logit (a logit bias that bans a token) has probability 0 and adds 0 to the entropy: no NaN."""
    h, w, _, targets = _inputs(False, rows=6, vocab=4)
    banned = torch.tensor([0.0, 0.0, 0.0, -float("inf")])
    plain = token_entropies(F.linear(h, w, banned), targets, chunk_size=4)
    _, chunked = chunked_token_log_probs_and_entropies(h, w, targets, 4, bias=banned)
    allowed = token_entropies(F.linear(h, w[:3]), targets)
    assert torch.isfinite(plain).all() and torch.isfinite(chunked).all()
    assert_equal_up_to_rounding(plain, allowed, name="plain", terms=6 + 4 + 16)
    assert_equal_up_to_rounding(chunked, allowed, name="chunked", terms=6 + 4 + 16)


def test_plain_log_probs_are_log_softmax_at_the_target():
    h, w, b, targets = _inputs(True)
    logits = F.linear(h, w, b)
    kept = targets != -100
    expected = F.log_softmax(torch.tanh(logits * 0.5 / 3.0) * 3.0, -1)[kept].gather(1, targets[kept, None]).squeeze(1)
    got = token_log_probs(logits, targets, softcap=3.0, scale=0.5)[kept]
    assert_equal_up_to_rounding(got, expected, name="log-probs", terms=TERMS)


def test_no_kept_target_gives_zeros_and_zero_gradients():
    h, w, _, targets = _inputs(False)
    out = chunked_token_log_probs(h, w, torch.full_like(targets, -100), 4)
    out.sum().backward()
    assert (out == 0).all() and (h.grad == 0).all() and (w.grad == 0).all()


def test_chunked_log_probs_follow_autocast_like_a_plain_linear():
    h, w, _, targets = _inputs(False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        chunked = chunked_token_log_probs(h, w, targets, 8)
        plain = token_log_probs(F.linear(h, w), targets)
    assert_equal_up_to_rounding(chunked, plain, name="log-probs", terms=TERMS)


def test_bad_inputs_are_refused():
    h, w, _, targets = _inputs(False)
    with pytest.raises(ValueError, match="hidden must be"):
        chunked_token_log_probs(h, w.t(), targets)
    with pytest.raises(TypeError, match="share one floating dtype"):
        chunked_token_log_probs(h, w.double(), targets)
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_token_log_probs(h, w, targets, 0)


@pytest.mark.parametrize(("softcap", "scale", "bias"), [(None, 1.0, False), (3.0, 0.5, True)])
def test_the_entropy_trains_with_the_gradient_of_the_full_logits_entropy(softcap, scale, bias):
    """An entropy bonus backpropagates through the entropies (chunked and plain), with the log-probabilities' share
    added: both equal autograd through the full logits' entropy."""
    h, w, b, targets = _inputs(bias)
    leaves = [t for t in (h, w, b) if t is not None]
    weights, entropy_weights = torch.randn(h.shape[0]), torch.randn(h.shape[0])
    scaled = F.linear(h, w, b) * scale
    transformed = scaled if softcap is None else torch.tanh(scaled / softcap) * softcap
    kept = (targets != -100).float()
    by_definition = torch.distributions.Categorical(logits=transformed).entropy() * kept
    reference = token_log_probs(F.linear(h, w, b), targets, softcap, scale)
    both = (reference * weights + by_definition * entropy_weights).sum()
    expected = torch.autograd.grad(both, leaves, retain_graph=True)
    logps, entropies = chunked_token_log_probs_and_entropies(h, w, targets, 5, softcap, b, scale)
    chunked = torch.autograd.grad((logps * weights + entropies * entropy_weights).sum(), leaves)
    plain = token_entropies(F.linear(h, w, b), targets, softcap, scale, chunk_size=5, with_grad=True)
    only_entropy = torch.autograd.grad((by_definition * entropy_weights).sum(), leaves, retain_graph=True)
    plain_grads = torch.autograd.grad((plain * entropy_weights).sum(), leaves)
    for name, got, want in [*zip("hwb", chunked, expected), *zip("hwb", plain_grads, only_entropy)]:
        assert_equal_up_to_rounding(got, want, name=name, terms=TERMS)


def test_the_entropy_gradient_of_a_banned_token_is_zero_not_nan():
    h, w, _, targets = _inputs(False, rows=6, vocab=4)
    banned = torch.tensor([0.0, 0.0, 0.0, -float("inf")])
    _, chunked = chunked_token_log_probs_and_entropies(h, w, targets, 4, bias=banned)
    plain = token_entropies(F.linear(h, w, banned), targets, with_grad=True)
    for entropy in (chunked, plain):
        (grad,) = torch.autograd.grad(entropy.sum(), [h])
        assert torch.isfinite(grad).all() and grad.abs().sum() > 0
