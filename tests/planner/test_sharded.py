"""Simulated per-rank memory of an FSDP2 step (Qwen3-4B width, 2 layers, 4k tokens, fp32 master weights,
bf16 compute): sharding over N ranks divides the fixed memory by N exactly, cpu_offload moves it to the
host, and what the device holds then is the gathered root (embedding, tied head, final norm, in bf16).

As for the other simulations, one child process (of ``preloaded_python``) computes what the tests check."""

from __future__ import annotations

import json

import pytest

P = 590_820_352  # parameters of the 2-layer model, head tied
ROOT = 151_936 * 2560 + 2560  # what is not in a decoder layer: the embedding (and head) and the final norm
FP32, BF16 = 4, 2

_SIMULATIONS = """
import json
from lit_memtrain.planner.sharded import simulate_sharded_step
from lit_memtrain.models.presets import build_config

config = build_config("qwen3-4b", {"num_hidden_layers": 2})
runs = {"1": {"world_size": 1}, "2": {"world_size": 2}, "2_offload": {"world_size": 2, "cpu_offload": True}}
print(json.dumps({name: simulate_sharded_step(config, 4096, **kwargs).__dict__ for name, kwargs in runs.items()}))
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


def test_one_rank_holds_parameters_gradients_and_adamw_state_in_fp32(simulated):
    assert simulated["1"]["fixed"] == 4 * FP32 * P


def test_two_ranks_hold_half_each_and_gather_the_root_in_bf16(simulated):
    two = simulated["2"]
    assert two["fixed"] * 2 == simulated["1"]["fixed"]
    assert two["device_peak"] < simulated["1"]["device_peak"]
    # At the peak: this rank's fp32 shards and the gathered root (embedding, tied head, final norm) in bf16.
    assert two["device_at_peak"]["parameters"] == FP32 * P // 2 + BF16 * ROOT


def test_cpu_offload_keeps_the_shards_in_host_memory(simulated):
    offload = simulated["2_offload"]
    assert offload["fixed"] == 0
    assert offload["host_peak"] >= simulated["2"]["fixed"]  # shards of parameters, gradients, AdamW state
    assert offload["device_at_peak"]["parameters"] == BF16 * ROOT
    assert offload["device_peak"] < simulated["2"]["device_peak"] - simulated["2"]["fixed"] // 2
