import pytest

from lit_memtrain.datamodules.validation_shares import StreamShares, UnscoredRepeats, ValidationShares


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


@pytest.mark.parametrize("replicas", [1, 2, 3, 4])
@pytest.mark.parametrize("rows", [0, 1, 2, 5, 7, 8, 9])
def test_a_stream_is_dealt_as_the_same_rows_in_a_list(rows, replicas):
    """Each rank's share of a stream, read whole on every rank, is the share ValidationShares deals of a list of
    the same rows: the same rows in the same order, and the same blanked repeats."""
    names = [f"row {i}" for i in range(rows)]
    blank = lambda row: f"blank {row}"  # noqa: E731
    for rank in range(replicas):
        streamed = list(StreamShares(iter(names), blank, num_replicas=replicas, rank=rank))
        if rows:
            listed = UnscoredRepeats(names, blank)
            assert streamed == [listed[i] for i in ValidationShares(listed, num_replicas=replicas, rank=rank)]
        else:
            assert streamed == []


def test_a_stream_share_of_a_rank_outside_the_replicas_is_refused():
    with pytest.raises(ValueError, match=r"rank must be in \[0, num_replicas=2\), got 2"):
        StreamShares([1, 2, 3], lambda row: row, num_replicas=2, rank=2)
