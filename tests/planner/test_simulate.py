"""Simulated memory at Qwen3-4B width (hidden 2560, MLP 9728, vocabulary 151,936) and 64k tokens.

The simulations run in a child process (of ``preloaded_python``, tests/conftest.py): registering the stand-in
device makes torch report an accelerator for the rest of the process, and must happen before the process's first
backward. One child computes everything the tests below check.
"""

from __future__ import annotations

import json

import pytest

from lit_memtrain.planner.simulate import simulate_step

L, H, I, HEADS, HEAD_DIM, LAYERS = 65536, 2560, 9728, 32, 128, 3
BF16 = 2
VOCAB = 151936

_SIMULATIONS = """
import contextlib
import json
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from lit_memtrain.techniques.loss import chunked_cross_entropy, cross_entropy
from lit_memtrain.planner.simulate import (
    fake_causal_lm, measure_peak, simulate_step, stand_in_device, tiles_simulated_once,
)
from lit_memtrain.techniques.rms_norm import chunked_rms_norm
from lit_memtrain.models.presets import build_config
from lit_memtrain.techniques.tiled_mlp import apply_tiled_mlp

L = 65536
device = stand_in_device()
results = {"device": [str(device), str(stand_in_device())]}
config = build_config("qwen3-4b", {"num_hidden_layers": 3})
with FakeTensorMode(allow_non_fake_inputs=True):
    model = fake_causal_lm(config)
    head, mlp = model.get_output_embeddings(), model.model.layers[0].mlp
    hidden = torch.empty(L, 2560, dtype=torch.bfloat16, device=device, requires_grad=True)
    targets = torch.zeros(L, dtype=torch.long, device=device)
    results["plain_loss"] = measure_peak(lambda: cross_entropy(head(hidden), targets).backward(), head, hidden, targets)
    results["chunked_loss"] = measure_peak(
        lambda: chunked_cross_entropy(hidden, head.weight, targets).backward(), head, hidden, targets
    )
    # Chunks of 9,000 rows, whose logits outweigh the head's gradients: 8, the last shorter; all against some.
    for key, selection in (("loss_chunks", contextlib.nullcontext), ("loss_chunks_once", tiles_simulated_once)):
        hidden.grad = head.weight.grad = None
        with selection():
            results[key] = measure_peak(
                lambda: chunked_cross_entropy(hidden, head.weight, targets, chunk_size=9000).backward(),
                head, hidden, targets,
            )
    x = torch.empty(1, L, 2560, dtype=torch.bfloat16, device=device, requires_grad=True)
    grad = torch.empty(1, L, 2560, dtype=torch.bfloat16, device=device)
    results["plain_mlp"] = measure_peak(lambda: mlp(x).backward(grad), mlp, x, grad)
    apply_tiled_mlp(model.model.layers)
    results["tiled_mlp"] = measure_peak(lambda: mlp(x).backward(grad), mlp, x, grad)
    calls = []
    mlp.down_proj.register_forward_hook(lambda *args: calls.append(1))
    with tiles_simulated_once():
        results["tiled_mlp_once"] = measure_peak(lambda: mlp(x).backward(grad), mlp, x, grad)
    results["tiles_simulated"] = len(calls)
    norm = model.model.layers[0].input_layernorm
    rows = torch.empty(1, L, 2560, dtype=torch.bfloat16, device=device, requires_grad=True)
    # Chunks of 5,000 rows: 14, the last shorter; forward alone, and forward and backward, all chunks against some.
    norm_forward = lambda: chunked_rms_norm(rows, norm.weight, 1e-6, 2560 * 5000)
    for name, run in (("norm_forward", norm_forward), ("norm_step", lambda: norm_forward().backward(grad))):
        for key, selection in ((name, contextlib.nullcontext), (f"{name}_once", tiles_simulated_once)):
            rows.grad = norm.weight.grad = None  # each run from the same state: no gradient accumulated
            with selection():
                results[key] = measure_peak(run, norm, rows, grad)
    gate = torch.empty(L, 9728, dtype=torch.bfloat16, device=device, requires_grad=True)
    grad_gate = torch.empty(L, 9728, dtype=torch.bfloat16, device=device)
    results["silu"] = measure_peak(lambda: torch.nn.functional.silu(gate).backward(grad_gate), gate, grad_gate)
    results["tied"] = model.lm_head.weight is model.model.embed_tokens.weight
for mode in ("full", "selective", "offload"):
    results[mode] = simulate_step(config, L, loss="chunked", checkpointing=mode)
one_layer = build_config("qwen3-4b", {"num_hidden_layers": 1})
for length in (4096, 8192, 12288):
    results[f"one_layer_{length}"] = simulate_step(one_layer, length, optimizer=False)
results["parameters"] = sum(p.numel() for p in model.parameters())
print(json.dumps({k: v.__dict__ if hasattr(v, "__dict__") else v for k, v in results.items()}))
"""


SIMULATIONS = ("-c", _SIMULATIONS)


def start_early(python) -> None:
    """Queued when collection ends (tests/conftest.py)."""
    python.start(*SIMULATIONS)


@pytest.fixture(scope="module")
def simulated(preloaded_python) -> dict:
    result = preloaded_python.run(*SIMULATIONS, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def _above_fixed(report: dict) -> int:
    return report["device_peak"] - report["fixed"]


def test_registration_is_idempotent_and_the_breakdown_adds_up(simulated):
    assert simulated["device"] == ["gpu:0", "gpu:0"]
    for mode in ("full", "selective", "offload"):
        report = simulated[mode]
        assert sum(report["device_at_peak"].values()) == report["device_peak"]
        # bf16 parameters, gradients and both AdamW moments: 8 bytes per parameter.
        assert report["fixed"] == 4 * BF16 * simulated["parameters"]


def test_chunked_loss_peak_is_under_5_percent_of_the_plain_loss(simulated):
    """The LM head and loss alone (hidden states in, gradients out): the plain loss holds L x V logits in
    bf16 and fp32 (~110 GiB at 64k tokens); the chunked loss a chunk of them and the fp32 head gradient."""
    plain, chunked = _above_fixed(simulated["plain_loss"]), _above_fixed(simulated["chunked_loss"])
    assert plain > 100 * 2**30
    assert chunked <= 0.05 * plain


def test_tiled_mlp_cuts_the_mlp_transient_8x(simulated):
    """MLP transient: the peak of one MLP's forward and backward above what any implementation holds
    (weights, their gradients, input, output and both gradients: four L x H tensors)."""
    required = 4 * L * H * BF16
    plain = _above_fixed(simulated["plain_mlp"]) - required
    tiled = _above_fixed(simulated["tiled_mlp"]) - required
    assert plain >= 4 * L * I * BF16  # gate, up, act(gate) and their product at least
    assert tiled * 8 <= plain


def test_repeated_tiles_are_not_simulated_and_the_peak_is_the_same(simulated):
    """64k tokens in tiles of about 2,560: 26 tiles; simulated: the first two and the last, in forward and
    again in backward (6 passes through the MLP instead of 52), with exactly the peak of all 26."""
    assert simulated["tiles_simulated"] == 6
    assert simulated["tiled_mlp_once"]["device_peak"] == simulated["tiled_mlp"]["device_peak"]


def test_repeated_norm_chunks_are_not_simulated_and_the_peak_is_the_same(simulated):
    """A chunked RMSNorm over 64k rows in chunks of 5,000: simulated, the first chunk and the last (shorter) one;
    forward alone and forward with backward peak at exactly the bytes of all 14, of each kind."""
    for name in ("norm_forward", "norm_step"):
        assert simulated[f"{name}_once"] == simulated[name], name
    chunk_fp32 = 5000 * 2560 * 4
    assert simulated["norm_step"]["device_peak"] > 2 * L * 2560 * 2 + chunk_fp32  # input, output, a chunk in fp32


def test_repeated_loss_chunks_are_not_simulated_and_the_peak_is_the_same(simulated):
    """The chunked loss over 64k tokens in chunks of 9,000 rows: simulated, the first chunk and the last (shorter)
    one; the peak of the loss with its backward is exactly that of all 8 chunks, of each kind, and it is in a chunk
    (above the head's fp32 and bf16 gradients and the logits of one chunk in fp32)."""
    assert simulated["loss_chunks_once"] == simulated["loss_chunks"]
    chunk_logits = 9000 * VOCAB * 4
    assert _above_fixed(simulated["loss_chunks"]) > VOCAB * H * (4 + 2) + chunk_logits


def test_silu_backward_is_one_operator_as_on_cuda(simulated):
    """Input, incoming gradient, output and input gradient: four L x I tensors, no intermediates."""
    assert simulated["silu"]["device_peak"] == 4 * L * I * BF16


def test_tied_embeddings_stay_tied(simulated):
    assert simulated["tied"]


def test_selective_checkpointing_costs_one_attention_output_per_layer(simulated):
    """What selective keeps per layer: the attention output, L x heads x head_dim in bf16 (4096 wide for
    Qwen3-4B, not the hidden size 2560), and its fp32 log-sum-exp, heads x L. At the peak (in a layer's
    backward) every layer not yet back-propagated holds them: between n - 1 and n layers' worth."""
    per_layer = L * HEADS * HEAD_DIM * BF16 + HEADS * L * 4
    extra = simulated["selective"]["device_peak"] - simulated["full"]["device_peak"]
    assert (LAYERS - 1) * per_layer <= extra <= LAYERS * per_layer


def test_offloaded_checkpoints_move_each_layer_input_to_the_host(simulated):
    """The host holds the layers' inputs and nothing else but a few scalars (AdamW's step counters live on
    the host). On the device, the activations at the peak are lighter by all of them; the peak itself moves
    from the last layer's backward (all inputs on the device) to the first layer's (more parameter gradients
    by then), so it drops by less than that but by more than one layer's input."""
    layer_input = L * H * BF16
    full, offload = simulated["full"], simulated["offload"]
    assert full["host_peak"] < 1024
    assert 0 <= offload["host_peak"] - LAYERS * layer_input < 1024
    activations = full["device_at_peak"]["activations"] - offload["device_at_peak"]["activations"]
    assert activations == LAYERS * layer_input
    assert full["device_peak"] - offload["device_peak"] > layer_input


def test_attention_memory_grows_linearly_with_the_sequence(simulated):
    """One layer, plain loss, no checkpointing: through the simulated flash kernel every 4k more tokens add
    the same memory. SDPA's math path instead (32 heads x L^2 scores) measured 1.92x more for the second
    step than for the first."""
    peaks = [simulated[f"one_layer_{length}"]["device_peak"] for length in (4096, 8192, 12288)]
    assert peaks[2] - peaks[1] == pytest.approx(peaks[1] - peaks[0], rel=1e-3)


_AFTER_BACKWARD = """
import torch
(torch.ones(1, requires_grad=True) * 2).sum().backward()
from lit_memtrain.planner.simulate import stand_in_device
stand_in_device()
"""


def test_simulating_after_autograd_ran_is_a_clear_error(preloaded_python):
    result = preloaded_python.run("-c", _AFTER_BACKWARD, timeout=120)
    assert result.returncode != 0
    assert "autograd ran here before the simulation's stand-in device was registered" in result.stderr


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"loss": "fused"}, "loss must be one of \\('plain', 'chunked'\\), got 'fused'"),
        ({"checkpointing": "all"}, "checkpointing must be None or one of \\('full', 'selective', 'offload'\\)"),
        ({"mlp_tiles": 4}, "mlp_tiles=4 has no effect without tiled_mlp=True"),
        ({"batch_size": 0}, "seq_len and batch_size must be positive"),
    ],
)
def test_invalid_arguments_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        simulate_step("tiny-qwen3", 128, **kwargs)
