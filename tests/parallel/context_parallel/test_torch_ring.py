"""torch's ring attention (CUDA): what is refused on any machine, and equality with one process on two GPUs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from cp_equivalence import Case, run_cases

from lit_memtrain.parallel.context_parallel import shard_batch, torch_ring_attention
from lit_memtrain.parallel.context_parallel.torch_ring import torch_ring_sdpa
from lit_memtrain.datamodules.padding_free import PaddingFreeCollator

CUDA_MESH = SimpleNamespace(device_type="cuda")


def single_document(method: str = "ring"):
    return shard_batch({"input_ids": torch.arange(8)[None], "labels": torch.arange(8)[None]}, 0, 2, method).layout


def test_packed_rows_are_refused_naming_the_document_aware_methods() -> None:
    packed = PaddingFreeCollator()([{"input_ids": torch.arange(5)}, {"input_ids": torch.arange(3)}])
    layout = shard_batch(packed, 0, 2, "ring").layout
    with pytest.raises(ValueError, match="takes no mask.*Use method='ulysses', or method='ring' with ring_backend='all_gather'"):
        with torch_ring_attention(CUDA_MESH, layout):
            pass


def test_only_cuda_ring_shards_are_accepted() -> None:
    with pytest.raises(ValueError, match="runs on CUDA only; got a 'cpu' mesh"):
        with torch_ring_attention(SimpleNamespace(device_type="cpu"), single_document()):
            pass
    with pytest.raises(ValueError, match="needs a batch sharded with method='ring', got 'ulysses'"):
        with torch_ring_attention(CUDA_MESH, single_document("ulysses")):
            pass


def test_attention_outside_the_context_raises_instead_of_attending_locally() -> None:
    states = torch.zeros(1, 2, 4, 8)
    with pytest.raises(RuntimeError, match="ran outside torch_ring_attention"):
        torch_ring_sdpa(states, states, states, single_document(), None, 0.0)


GPU_MODEL = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 64, "vocab_size": 2048}  # fmt: skip
GPU_CASES = [
    Case("torch-ring-single-document", "ring", (1021,), overrides=GPU_MODEL, dtype="bfloat16", loss="chunked",
         ring_backend="torch"),
    Case("all-gather-ring-packed", "ring", (700, 90, 333), overrides=GPU_MODEL, dtype="bfloat16", loss="chunked"),
    Case("ulysses-packed", "ulysses", (700, 90, 333), overrides=GPU_MODEL, dtype="bfloat16", loss="chunked"),
]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(
    torch.cuda.device_count() < 2,
    reason=f"needs 2 CUDA devices for a ring across GPUs, found {torch.cuda.device_count()}",
)
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda case: case.name)
def test_cuda_bf16_two_gpus_match_one_process(case: Case, tmp_path) -> None:
    """bf16 on both sides, different kernels and summation orders: compared at bf16 tolerance (loss 2e-2
    relative; each gradient's error norm within 5e-2 of its norm)."""
    result = run_cases([case], tmp_path, backend="nccl")[case.name]
    assert "error" not in result, result.get("trace")
    (expected_loss, expected_grads), (loss, grads) = result["reference"], result["cp"]
    assert loss == pytest.approx(expected_loss, rel=2e-2)
    for name, expected in expected_grads.items():
        error = (grads[name].float() - expected.float()).norm() / expected.float().norm().clamp(min=1e-12)
        assert error < 5e-2, f"{name}: relative error {error:.3g}"
