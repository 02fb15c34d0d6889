"""The reward step's plain-torch parts: the reward token is where transformers' sequence classification reads it
(padded and padding-free, pad == eos included), the Bradley-Terry loss is TRL's formula, and a step's metrics over
ranks weigh every pair the same."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForSequenceClassification

from lit_memtrain.models.presets import build_config
from lit_memtrain.objectives.reward_loss import (
    bradley_terry_losses,
    last_token_positions,
    metrics_from_statistics,
    step_statistics,
)

PAD = 0


def _hf_reading(input_ids: torch.Tensor, pad: int) -> torch.Tensor:
    """The row positions transformers' *ForSequenceClassification reads (its own forward on a tiny model)."""
    torch.manual_seed(0)
    config = build_config("tiny-qwen3", {"num_hidden_layers": 1, "pad_token_id": pad, "num_labels": 1})
    model = AutoModelForSequenceClassification.from_config(config).eval()
    captured = {}
    model.score.register_forward_hook(lambda module, args, out: captured.update(out=out))
    with torch.no_grad():
        pooled = model(input_ids=input_ids).logits[:, 0]
    per_token = captured["out"][..., 0]
    return torch.stack([(per_token[row] == pooled[row]).nonzero()[0, 0] for row in range(len(pooled))])


@pytest.mark.parametrize("eos", [2, PAD], ids=["pad-differs-from-eos", "pad-is-eos"])
def test_the_reward_token_is_where_transformers_reads_a_padded_row_and_the_same_padding_free(eos):
    sequences = [[5, 6, 7, eos], [8, 9, eos], [PAD, PAD]]  # the last one is all padding ids
    width = 6
    padded = torch.full((len(sequences), width), PAD)
    owners = torch.full((len(sequences), width), len(sequences))
    for row, ids in enumerate(sequences):
        padded[row, : len(ids)] = torch.tensor(ids)
        owners[row, : len(ids)] = row
    positions = last_token_positions(padded, owners, len(sequences), PAD)
    rows = torch.arange(len(sequences)) * width
    assert (positions - rows).tolist() == _hf_reading(padded, PAD).tolist()
    assert (positions - rows).tolist() == ([3, 2, 0] if eos != PAD else [2, 1, 0])

    flat = torch.tensor([token for ids in sequences for token in ids] + [PAD, PAD])  # padding segment last
    flat_owners = torch.tensor([row for row, ids in enumerate(sequences) for _ in ids] + [len(sequences)] * 2)
    starts = torch.tensor([0, 4, 7])
    expected = (positions - rows) + starts
    assert last_token_positions(flat[None], flat_owners[None], len(sequences), PAD).tolist() == expected.tolist()


def test_the_mean_of_the_bradley_terry_losses_is_trls_formula_with_margin_and_centering():
    chosen, rejected, margin = torch.tensor([1.5, -0.2, 0.3]), torch.tensor([0.5, 0.1, 0.3]), torch.tensor([0.2, 0, 1])
    losses = bradley_terry_losses(chosen, rejected)
    torch.testing.assert_close(losses, -F.logsigmoid(chosen - rejected))
    with_margin = -F.logsigmoid(chosen - rejected - margin).mean() + 0.01 * ((chosen + rejected) ** 2).mean()
    assert bradley_terry_losses(chosen, rejected, margin, 0.01).mean() == pytest.approx(float(with_margin))


def test_metrics_over_ranks_weigh_every_pair_the_same():
    ranks = [(torch.tensor(0.5), torch.tensor([2.0, 0.0, 1.0]), torch.tensor([1.0, 0.5, 1.0])),
             (torch.tensor(0.25), torch.tensor([-1.0]), torch.tensor([-3.0]))]  # fmt: skip
    statistics = torch.stack([step_statistics(*rank) for rank in ranks])
    metrics = metrics_from_statistics(statistics)
    chosen = torch.cat([rank[1] for rank in ranks])
    rejected = torch.cat([rank[2] for rank in ranks])
    assert metrics["loss"] == pytest.approx((0.5 * 3 + 0.25) / 4)
    assert metrics["accuracy"] == pytest.approx(2 / 4)  # strictly greater: the tie 1.0 vs 1.0 is not counted
    assert metrics["margin"] == pytest.approx(float((chosen - rejected).mean()))
    assert metrics["rewards/chosen"] == pytest.approx(float(chosen.mean()))
    assert metrics["rewards/rejected"] == pytest.approx(float(rejected.mean()))
    assert metrics["mean_reward"] == pytest.approx(float(torch.cat([chosen, rejected]).mean()))
    assert (float(metrics["min_reward"]), float(metrics["max_reward"])) == (-3.0, 2.0)
    one = metrics_from_statistics(step_statistics(*ranks[0]))
    assert one["accuracy"] == pytest.approx(1 / 3)
