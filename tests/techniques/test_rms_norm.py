"""The chunked RMSNorm equals the model's own (Qwen3, Llama): forward, gradients, the probe's verdicts; the planner's
hooks choose the chunks that run and the probe."""

from __future__ import annotations

import pytest
import torch
from equivalence import assert_equal_up_to_rounding
from torch import nn
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from lit_memtrain.techniques.rms_norm import (
    apply_chunked_rms_norm,
    chunked_rms_norm,
    probe_rms_norm,
    probed_with,
    selected_chunks,
)

HIDDEN = 48


def _norm(cls: type, dtype: torch.dtype) -> nn.Module:
    norm = cls(HIDDEN, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(1.0 + 0.3 * torch.randn(HIDDEN, generator=torch.Generator().manual_seed(1)))
    return norm


def _forward_backward(fn, norm: nn.Module, x: torch.Tensor, grad: torch.Tensor):
    x = x.detach().requires_grad_(True)
    norm.weight.grad = None
    out = fn(x)
    out.backward(grad)
    return out.detach(), x.grad, norm.weight.grad


@pytest.mark.parametrize("cls", [Qwen3RMSNorm, LlamaRMSNorm])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_and_gradients_equal_the_models_norm(cls, dtype):
    norm = _norm(cls, dtype)
    generator = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(2, 37, 4, HIDDEN, generator=generator)).to(dtype)  # [batch, tokens, heads, head_dim]
    grad = torch.randn(x.shape, generator=generator).to(dtype)
    expected = _forward_backward(norm, norm, x, grad)
    chunk = HIDDEN * 5  # 5 rows a chunk: 30 chunks, the last shorter
    got = _forward_backward(lambda t: chunked_rms_norm(t, norm.weight, norm.variance_epsilon, chunk), norm, x, grad)
    assert torch.equal(got[0], expected[0])  # the module's own operations on each chunk
    if dtype == torch.float32:  # the input's gradient sums over the hidden size, the weight's over the rows too
        assert_equal_up_to_rounding(got[1], expected[1], name="input gradient", terms=HIDDEN)
        assert_equal_up_to_rounding(got[2], expected[2], name="weight gradient", terms=x.numel() // HIDDEN + HIDDEN)
    else:  # bf16: its own rounding; autograd sums the weight's gradient in bf16, the chunks in fp32
        torch.testing.assert_close(got[1], expected[1])
        # compare both weight gradients with the fp64 one
        reference = _forward_backward(norm.to(torch.float64), norm, x.double(), grad.double())[2]
        assert (got[2].double() - reference).abs().max() <= (expected[2].double() - reference).abs().max() + 0.25


def test_under_autocast_the_output_dtype_and_values_are_the_models():
    norm = _norm(Qwen3RMSNorm, torch.float32)  # fp32 weights, bf16 activations: bf16-mixed
    x = torch.randn(3, 20, HIDDEN).to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected, got = norm(x), chunked_rms_norm(x, norm.weight, norm.variance_epsilon, HIDDEN * 7)
    assert got.dtype == expected.dtype and torch.equal(got, expected)


def test_only_the_input_and_rstd_are_saved():
    norm = _norm(Qwen3RMSNorm, torch.bfloat16)
    x = torch.randn(64, HIDDEN, dtype=torch.bfloat16, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        chunked_rms_norm(x, norm.weight, norm.variance_epsilon, HIDDEN * 8)
    assert sorted((tuple(t.shape), t.dtype) for t in saved) == sorted(
        [((64, HIDDEN), torch.bfloat16), ((HIDDEN,), torch.bfloat16), ((64, 1), torch.float32)]
    )


def test_the_probe_accepts_llama_and_qwen3_and_rejects_other_norms():
    assert probe_rms_norm(_norm(Qwen3RMSNorm, torch.bfloat16)) is None
    assert probe_rms_norm(_norm(LlamaRMSNorm, torch.float32)) is None
    assert "variance_epsilon" in probe_rms_norm(GemmaRMSNorm(HIDDEN))  # 1 + weight, under another name

    class WeightInFp32(LlamaRMSNorm):  # same attributes, weight applied before the cast back
        def forward(self, hidden_states):
            x = hidden_states.float()
            x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
            return (self.weight.float() * x).to(hidden_states.dtype)

    assert "differs" in probe_rms_norm(_norm(WeightInFp32, torch.bfloat16))


def test_a_norm_that_differs_only_under_mixed_precision_is_refused():
    """OLMo 2's norm multiplies by its weight in fp32, then casts back: on fp32 inputs that is the chunked norm, but
    under bf16-mixed (fp32 weights, bf16 activations) its output is bf16 and rounded after the weight."""
    norm = _norm(Olmo2RMSNorm, torch.float32)
    x = (3 * torch.randn(2, 8, HIDDEN, generator=torch.Generator().manual_seed(0))).to(torch.bfloat16)
    with torch.no_grad():
        own, chunked = norm(x), chunked_rms_norm(x, norm.weight, norm.variance_epsilon)
    assert own.dtype == torch.bfloat16 and chunked.dtype == torch.float32
    assert "on torch.bfloat16 inputs with a torch.float32 weight" in probe_rms_norm(norm)
    assert probe_rms_norm(_norm(Qwen3RMSNorm, torch.float32)) is None  # its weight multiplies after the cast back


def test_apply_replaces_the_norms_it_proves_and_restores_them():
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = _norm(Qwen3RMSNorm, torch.float32), GemmaRMSNorm(HIDDEN)

    block = Block()
    restore, skipped = apply_chunked_rms_norm(block.modules())
    assert "forward" in vars(block.a) and "forward" not in vars(block.b)
    assert list(skipped) == ["GemmaRMSNorm"]
    with pytest.raises(ValueError, match="already chunked"):
        apply_chunked_rms_norm(block.modules())
    restore()
    assert "forward" not in vars(block.a)
    with pytest.raises(ValueError, match="chunk_elements must be a positive int"):
        apply_chunked_rms_norm(block.modules(), chunk_elements=0)


def test_selected_chunks_run_only_the_chunks_kept_and_the_others_stay_unwritten():
    norm = _norm(Qwen3RMSNorm, torch.float32)
    x = torch.randn(10, HIDDEN, generator=torch.Generator().manual_seed(2), requires_grad=True)
    expected = norm(x)
    seen = []

    def first_and_last(bounds):
        seen.append(bounds)
        return [bounds[0], bounds[-1]]

    with selected_chunks(first_and_last):
        out = chunked_rms_norm(x, norm.weight, norm.variance_epsilon, chunk_elements=HIDDEN * 3)
        out.sum().backward()
    assert seen[0] == [(0, 3), (3, 6), (6, 9), (9, 10)] and len(seen) == 2  # forward, then backward
    assert torch.equal(out[:3], expected[:3]) and torch.equal(out[9:], expected[9:])
    out = chunked_rms_norm(x, norm.weight, norm.variance_epsilon, chunk_elements=HIDDEN * 3)  # the context is closed
    assert torch.equal(out, expected) and len(seen) == 2


def test_probed_with_replaces_the_probe_while_open():
    norm = _norm(Qwen3RMSNorm, torch.float32)
    with probed_with(lambda module, dtypes: "refused by the test's probe"):
        restore, skipped = apply_chunked_rms_norm([norm])
    assert skipped == {"Qwen3RMSNorm": "refused by the test's probe"} and "forward" not in vars(norm)
    restore()
    restore, skipped = apply_chunked_rms_norm([norm])  # probe_rms_norm again
    assert not skipped and "forward" in vars(norm)
    restore()
