"""Context parallelism on 2 and 4 gloo ranks equals one process on the whole row: loss and every gradient.

Tolerances (tests/equivalence.py): with the loss computed in float64 (logits and cross-entropy) both sides are
float64 end to end and are held to float64's rounding. With the project's chunked loss, logits are computed in fp32
whatever the input dtype (design.md), so values carry fp32 rounding that depends on how rows are grouped: they are
held to fp32's.
"""

from __future__ import annotations

import pytest
import torch
from cp_equivalence import YARN, Case, run_cases
from equivalence import TINY_MODEL_TERMS, assert_each_equal_up_to_rounding, assert_equal_up_to_rounding

YARN_OVERRIDES = {"max_position_embeddings": 64, "rope_parameters": YARN}
PACKED = (11, 7, 13)  # 31 tokens: padded to 32 for both methods at cp 2

CASES_CP2 = [
    Case("ulysses-single-document-sdpa", "ulysses", (32,), inner="sdpa"),
    Case("ulysses-single-document-padded", "ulysses", (31,)),
    Case("ulysses-packed-kv2", "ulysses", PACKED),
    Case("ulysses-packed-kv1", "ulysses", PACKED, overrides={"num_key_value_heads": 1}),
    Case("ulysses-packed-llama-yarn", "ulysses", PACKED, preset="tiny-llama", overrides=YARN_OVERRIDES),
    Case("ulysses-packed-checkpointing-tiled-mlp", "ulysses", PACKED, checkpointing={}, tiled_mlp=True),
    Case("ulysses-packed-chunked-loss", "ulysses", PACKED, loss="chunked"),
    Case("ulysses-two-rows", "ulysses", (15,), batch_rows=2, inner="sdpa"),
    Case("ring-single-document-padded", "ring", (30,)),
    Case("ring-packed-kv2", "ring", PACKED),
    Case("ring-packed-kv1", "ring", PACKED, overrides={"num_key_value_heads": 1}),
    Case("ring-packed-yarn", "ring", PACKED, overrides=YARN_OVERRIDES),
    Case("ring-packed-chunked-loss", "ring", PACKED, loss="chunked"),
    Case("ring-packed-selective-offloaded-checkpointing-tiled-mlp", "ring", PACKED,
         checkpointing={"selective": True, "offload": True}, tiled_mlp=True),  # fmt: skip
    Case("ring-two-rows", "ring", (13,), batch_rows=2),
]
CASES_CP4 = [  # kv_heads 2 at cp 4: each key/value head replicated on two ranks
    Case("ulysses-packed-kv2-cp4", "ulysses", (9, 14, 6), cp=4),
    Case("ring-packed-kv2-cp4", "ring", (9, 14, 6), cp=4),
]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """One launch of 4 ranks for every case (starting processes costs more than the cases)."""
    return run_cases(CASES_CP2 + CASES_CP4, tmp_path_factory.mktemp("context-parallel"))


def assert_equal_to_one_process(case: Case, result: dict) -> None:
    assert "error" not in result, result.get("trace")
    (expected_loss, expected_grads), (loss, grads) = result["reference"], result["cp"]
    computed_in = torch.float32 if case.loss == "chunked" else torch.float64
    assert_equal_up_to_rounding(loss, expected_loss, name="loss", terms=TINY_MODEL_TERMS, computed_in=computed_in)
    assert_each_equal_up_to_rounding(grads, expected_grads, terms=TINY_MODEL_TERMS, computed_in=computed_in)


@pytest.mark.parametrize("case", CASES_CP2, ids=lambda case: case.name)
def test_cp2_equals_one_process(case: Case, results) -> None:
    assert_equal_to_one_process(case, results[case.name])


@pytest.mark.parametrize("case", CASES_CP4, ids=lambda case: case.name)
def test_cp4_equals_one_process(case: Case, results) -> None:
    assert_equal_to_one_process(case, results[case.name])


def test_padding_added_is_reported(results) -> None:
    assert results["ulysses-packed-kv2"]["padding"] == 1  # 31 -> 32 (a multiple of cp = 2)
    assert results["ring-single-document-padded"]["padding"] == 2  # 30 -> 32 (a multiple of 2 * cp = 4)
    assert results["ulysses-single-document-sdpa"]["padding"] == 0


def test_misuse_raises_clear_errors_before_any_exchange(results) -> None:
    errors = results["misuse"]  # every rank raised and then met the others at a barrier: nothing hung
    assert errors["heads"].startswith("ValueError: method='ulysses' with context_parallel_size=2 needs")
    assert "Sizes that work for this model: [1, 3]" in errors["heads"]
    assert "flash-attn package" in errors["flash_missing"]
    assert errors["flash_head_dim"] == (
        "ValueError: inner='flash_attention_2' cannot run Qwen3ForCausalLM: its attention heads have 320 dimensions "
        "and flash-attn's kernels stop at 256; use inner='sdpa_by_document'."
    )
    assert errors["before_set_layout"].startswith("RuntimeError: Context-parallel attention ran before set_layout")
    assert "sharded for method='ring'" in errors["ring_layout"]
    assert "inner attention 'sdpa' is one causal call over the row, but this row holds 2 segments" in errors["sdpa_packed"]
    assert "already has context-parallel attention installed" in errors["installed_twice"]
    assert "layout set last is for 1 row(s) of 8 tokens" in errors["stale_layout"]
    assert "called with position_ids that are not the shard's" in errors["no_positions"]
    assert "called with an attention_mask under context-parallel attention" in errors["attention_mask"]
    assert errors["uninstalled"] == "sdpa"
