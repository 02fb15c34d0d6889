import pytest

from lit_memtrain.datamodules.validation_shares import UnscoredRepeats, ValidationShares


@pytest.mark.parametrize("replicas", [1, 2, 3, 4])
@pytest.mark.parametrize("rows", [1, 2, 5, 7, 8, 9])
def test_every_row_once_and_every_rank_as_many(rows, replicas):
    """Ranks get equal shares; the real rows are dealt once each, in DistributedSampler's order; the rest are
    blanked repeats, as few as evening out needs."""
    data = UnscoredRepeats([f"row {i}" for i in range(rows)], unscored=lambda row: f"blank {row}")
    shares = [[data[i] for i in ValidationShares(data, num_replicas=replicas, rank=rank)] for rank in range(replicas)]
    assert len({len(share) for share in shares}) == 1
    real = [row for share in shares for row in share if row.startswith("row")]
    assert sorted(real) == sorted(f"row {i}" for i in range(rows))
    blanks = [row for share in shares for row in share if row.startswith("blank")]
    assert len(blanks) == -rows % replicas
    assert [data[i] for i in ValidationShares(data, num_replicas=replicas, rank=0)][0] == "row 0"


def test_a_plain_dataset_is_refused():
    with pytest.raises(TypeError, match="wrap the validation rows in UnscoredRepeats"):
        ValidationShares([1, 2, 3], num_replicas=2, rank=0)
