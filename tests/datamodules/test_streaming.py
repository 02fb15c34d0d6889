"""Streaming (issue 13, point 3): pack_dataset(IterableDataset) and SFTDataModule(streaming=True).

Every token is accounted for with a corpus many windows long, a resumed stream yields exactly the rows
an uninterrupted one would, the fill stays within half a point of the global plan, each data-parallel
rank reads its own share, and peak host memory does not grow with the corpus.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import datasets
import numpy as np
import pyarrow as pa
import pytest
from torch.utils.data import DataLoader

from lit_memtrain.datamodules.packing import pack_dataset
from lit_memtrain.datamodules.padding_free import PaddingFreeCollator
from lit_memtrain.datamodules.sft import SFTDataModule
from lit_memtrain.datamodules.streaming import PackedStream

STRATEGIES = [None, "bfd", "bfd_split", "wrapped"]


def unique_tokens(lengths) -> datasets.Dataset:
    """Token ids unique across the dataset; labels are ids + 10**6, so a misaligned column shows."""
    offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int32)
    ids = pa.ListArray.from_arrays(pa.array(offsets), pa.array(np.arange(offsets[-1], dtype=np.int32)))
    labels = pa.ListArray.from_arrays(pa.array(offsets), pa.array(np.arange(offsets[-1], dtype=np.int32) + 10**6))
    return datasets.Dataset(pa.table({"input_ids": ids, "labels": labels}))


def lognormal(count: int, median: float = 300, high: int = 16384, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(np.rint(rng.lognormal(np.log(median), 1.0, count)), 1, high).astype(np.int64)


def one_pass(stream: PackedStream) -> list[dict]:
    """The rows of a stream's first pass (a training stream repeats for ever)."""
    return list(itertools.takewhile(lambda _: stream.current_position["pass"] == 0, stream))


def check_documents(rows, examples, max_length, strategy):
    """Rows fit, labels stay aligned, and each document is a whole example, its head, or one of its chunks."""
    starts = {ids[0]: ids for ids in examples if len(ids)}
    for row in rows:
        assert 0 < len(row["input_ids"]) <= max_length
        np.testing.assert_array_equal(row["labels"], row["input_ids"] + 10**6)
        if strategy in ("bfd", "bfd_split"):
            bounds = [0, *itertools.accumulate(row["seq_lengths"])]
            for a, b in itertools.pairwise(bounds):
                document = row["input_ids"][a:b].tolist()
                first = max(start for start in starts if start <= document[0])
                offset = document[0] - first
                assert offset % max_length == 0 and document == starts[first][offset : offset + len(document)]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_stream_many_windows_long_accounts_for_every_token(strategy):
    lengths = lognormal(1500, median=40, high=400, seed=1)
    lengths[::50] = 0
    source = unique_tokens(lengths)
    examples = [list(range(a, b)) for a, b in itertools.pairwise(np.concatenate(([0], np.cumsum(lengths))))]
    stream = PackedStream(source.to_iterable_dataset(num_shards=3), 64, strategy, buffer_size=100, seed=3)
    rows = list(stream)
    check_documents(rows, examples, 64, strategy)
    keep = 64 if strategy in (None, "bfd") else None
    expected = [t for ids in examples for t in ids[:keep]]
    assert sorted(t for row in rows for t in row["input_ids"].tolist()) == expected
    counts = stream.counts
    assert (counts.examples, counts.tokens) == (len(lengths), int(lengths.sum()))
    assert counts.kept_tokens == len(expected) and counts.truncated_tokens == int(lengths.sum()) - len(expected)
    if strategy == "wrapped":  # rows are blocks of the concatenation, shuffled within each window
        assert Counter(map(len, (row["input_ids"] for row in rows)))[64] >= len(rows) - 2


@pytest.mark.parametrize("strategy", ["bfd", "bfd_split", "wrapped"])
def test_pack_dataset_gives_a_stream_back_as_trl_does(strategy):
    """TRL's own streaming test calls ``.batch`` on what ``pack_dataset`` returns for an ``IterableDataset``
    (issue 22, point 6): the same type back, the same rows, the source's format kept."""
    import trl

    examples = {"input_ids": [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10], [11]],
                "attention_mask": [[1, 1, 1, 0, 0], [1, 0], [1, 1, 0], [1]]}  # fmt: skip
    ours = pack_dataset(datasets.Dataset.from_dict(examples).to_iterable_dataset(), 4, strategy)
    theirs = trl.pack_dataset(datasets.Dataset.from_dict(examples).to_iterable_dataset(), 4, strategy)
    assert isinstance(ours, datasets.IterableDataset)
    assert next(iter(ours.batch(batch_size=4))) == next(iter(theirs.batch(batch_size=4)))
    assert list(ours.features) == ["input_ids", "attention_mask"] + (["seq_lengths"] if strategy != "wrapped" else [])
    torch_source = datasets.Dataset.from_dict(examples).to_iterable_dataset().with_format("torch")
    assert next(iter(pack_dataset(torch_source, 4, strategy)))["input_ids"].tolist() == [1, 2, 3, 4]


def test_a_packed_stream_maps_shuffles_resumes_and_loads_with_workers_as_a_datasets_stream():
    source = unique_tokens([5, 3, 9, 2, 6] * 20)

    def packed():
        return pack_dataset(source.to_iterable_dataset(), 8, "bfd_split", buffer_size=7)

    rows = [row["input_ids"] for row in packed()]
    assert sorted(t for ids in rows for t in ids) == list(range(500))
    mapped = packed().map(lambda row: {"tokens": len(row["input_ids"])})
    assert [row["tokens"] for row in mapped] == list(map(len, rows))
    shuffled = [row["input_ids"] for row in packed().shuffle(seed=0, buffer_size=100)]
    assert shuffled != rows and sorted(shuffled) == sorted(rows)
    first = packed()
    head = [row["input_ids"] for row in itertools.islice(first, 9)]
    resumed = packed()
    resumed.load_state_dict(first.state_dict())
    assert head + [row["input_ids"] for row in resumed] == rows
    loader = DataLoader(packed(), batch_size=1, num_workers=2, collate_fn=PaddingFreeCollator())
    assert [batch["input_ids"][0].tolist() for batch in loader] == rows  # one shard: one worker reads it all


def test_a_stream_that_declares_no_features_packs_into_python_lists(tmp_path):
    path = tmp_path / "tokens.jsonl"
    path.write_text("".join(json.dumps({"input_ids": list(range(i, i + 5)), "id": i}) + "\n" for i in range(0, 50, 5)))
    source = datasets.load_dataset("json", data_files=str(path), streaming=True)["train"]
    rows = list(pack_dataset(source, 16, "bfd"))
    assert all(type(row["input_ids"]) is list and list(row) == ["input_ids", "seq_lengths"] for row in rows)
    assert sorted(t for row in rows for t in row["input_ids"]) == list(range(50))


@pytest.mark.parametrize("rows", [0, 3])
def test_a_repeating_stream_with_no_row_to_give_is_an_error_not_a_hang(tmp_path, rows):
    """A rank whose share is empty, or whose examples all have nothing to train, would read empty passes for ever."""
    from lit_memtrain.datamodules.streaming import TokenizedWindow
    from lit_memtrain.datamodules.tokenize import TokenCounts

    def nothing_to_train(raw, first_index):
        empty = pa.array([], pa.list_(pa.int32()))
        table = pa.table({"input_ids": empty, "labels": empty})
        count = len(raw["text"])
        counts = TokenCounts(examples=count, tokens=count, dropped_examples=count, dropped_tokens=count)
        return TokenizedWindow(table, counts)

    passes = []

    def stop_looping(counts):
        passes.append(counts)
        if len(passes) > 3:
            raise RuntimeError("the stream read empty passes over and over")

    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": "a"}) + "\n" for _ in range(3)))
    source = datasets.load_dataset("json", data_files=str(path), streaming=True)["train"].skip(3 - rows)
    stream = PackedStream(source, 8, "bfd", 2, tokenize=nothing_to_train, repeat=True, on_pass_end=stop_looping)
    with pytest.raises(ValueError, match=rf"no row in a whole pass \({rows} examples read, {rows} of them dropped"):
        next(iter(stream))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_resumed_stream_yields_the_rows_an_uninterrupted_one_would(strategy):
    source = unique_tokens(lognormal(600, median=40, high=300, seed=2))

    def stream():
        return PackedStream(source.to_iterable_dataset(num_shards=2), 64, strategy, buffer_size=70, seed=5)

    rows = [row["input_ids"].tolist() for row in stream()]
    for stop in (1, 9, len(rows) // 2, len(rows) - 1):
        first = stream()
        head = [row["input_ids"].tolist() for row in itertools.islice(first, stop)]
        resumed = stream()
        resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))  # plain values: survive a checkpoint
        assert head + [row["input_ids"].tolist() for row in resumed] == rows


@pytest.mark.parametrize("max_length", [2048, 8192])
def test_stream_fill_is_within_half_a_point_of_the_global_plan(max_length):
    source = unique_tokens(lognormal(20_000))
    whole = pack_dataset(source, max_length, "bfd")
    streamed = list(pack_dataset(source.to_iterable_dataset(), max_length, "bfd", buffer_size=1000))
    tokens = sum(len(row["input_ids"]) for row in streamed)
    assert tokens == sum(map(len, whole["input_ids"]))
    global_fill = tokens / (len(whole) * max_length)
    assert global_fill - tokens / (len(streamed) * max_length) < 0.005


def test_bad_json_deep_in_a_stream_is_named(tmp_path):
    path = tmp_path / "tokens.jsonl"
    lines = [json.dumps({"input_ids": list(range(i, i + 20))}) for i in range(200)]
    lines[150] = '{"input_ids": [1, 2,, 3]}'
    path.write_text("\n".join(lines) + "\n")
    source = datasets.load_dataset("json", data_files=str(path), streaming=True, chunksize=512)["train"]
    stream = PackedStream(source, 64, "bfd", buffer_size=10, files=(str(path),))
    with pytest.raises(ValueError, match=r"tokens.jsonl:151:21: not valid JSON"):
        list(stream)


_RSS_SCRIPT = """
import json, resource, sys
import datasets
from lit_memtrain.datamodules.packing import pack_dataset
for path in sys.argv[1:]:
    stream = datasets.load_dataset("json", data_files=path, streaming=True)["train"]
    tokens = sum(len(row["input_ids"]) for row in pack_dataset(stream, 2048, "bfd_split", buffer_size=500))
    print(json.dumps({"tokens": tokens, "peak_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
"""


def test_peak_host_memory_does_not_grow_with_the_corpus(tmp_path):
    """A corpus streamed and packed after one 5x smaller, in one fresh process: the peak resident memory
    does not rise, where the larger corpus's token ids alone would take 14 MB more.

    Every 1,000 examples repeat the same lengths, so every window is alike and any growth is ours. Peak RSS
    is repeatable to ~1 MB only with glibc told to map large blocks (``MALLOC_MMAP_THRESHOLD_``) and Arrow
    on the system allocator (mimalloc keeps freed pages, which adds tens of MB of noise). JSON lines, not
    Parquet: ``datasets`` 5.2 with pyarrow 26 keeps every Parquet row group it has streamed in memory.
    """
    pattern = lognormal(1000, median=300, high=8192)
    paths, totals = [], []
    for count in (2_000, 10_000):
        lengths = np.tile(pattern, count // 1000)
        ends = np.cumsum(lengths)
        paths.append(tmp_path / f"corpus-{count}.jsonl")
        paths[-1].write_text("".join(
            '{"input_ids": [' + ",".join(map(str, range(end - length, end))) + "]}\n"
            for end, length in zip(ends.tolist(), lengths.tolist())
        ))
        totals.append(int(lengths.sum()))
    env = {
        **os.environ,
        "MALLOC_MMAP_THRESHOLD_": "65536",
        "ARROW_DEFAULT_MEMORY_POOL": "system",
        "PYTHONPATH": str(Path(__file__).parents[2]),
    }
    out = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, *map(str, paths)], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    small, large = (json.loads(line) for line in out.stdout.strip().splitlines()[-2:])
    assert [small["tokens"], large["tokens"]] == totals
    assert 4 * (large["tokens"] - small["tokens"]) > 12 * 2**20
    assert large["peak_kib"] - small["peak_kib"] < 4 * 1024, (small, large)


# --- through SFTDataModule(streaming=True) -----------------------------------------------------------------------


def write_text_corpus(path: Path, count: int = 120) -> list[dict[str, str]]:
    rng = np.random.default_rng(0)
    words = ["".join(rng.choice(list("abcdefghij"), rng.integers(2, 7))) for _ in range(100)]
    rows = [{"text": " ".join(rng.choice(words, rng.integers(3, 120)))} for _ in range(count)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return rows


def stream_module(path, world=1, rank=0, **kwargs):
    dm = SFTDataModule(dataset=str(path), streaming=True, max_length=48, buffer_size=16, **kwargs)
    dm.trainer = SimpleNamespace(
        max_steps=10, strategy=SimpleNamespace(distributed_sampler_kwargs={"num_replicas": world, "rank": rank})
    )
    dm.setup("fit")
    return dm


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_datamodule_streams_every_token_it_would_keep_in_memory(tmp_path, strategy):
    path = tmp_path / "corpus.jsonl"
    write_text_corpus(path)
    packing = {"packing": strategy is not None, "packing_strategy": strategy or "bfd"}
    in_memory = SFTDataModule(dataset=str(path), max_length=48, **packing)
    in_memory.setup("fit")
    streamed = stream_module(path, **packing)
    rows = one_pass(streamed.train_dataset)
    assert Counter(t for row in rows for t in row["input_ids"].tolist()) == Counter(
        t for ids in in_memory.train_dataset["input_ids"] for t in ids
    )
    assert streamed.token_counts["train"] == in_memory.token_counts["train"]
    assert next(iter(streamed.train_dataloader()))["input_ids"].shape[0] == (1 if strategy else 8)


def test_each_data_parallel_rank_streams_its_own_share(tmp_path):
    path = tmp_path / "corpus.jsonl"
    write_text_corpus(path)
    whole = one_pass(stream_module(path, packing=True, packing_strategy="bfd_split").train_dataset)
    shares = [one_pass(stream_module(path, world=2, rank=rank, packing=True, packing_strategy="bfd_split").train_dataset)
              for rank in (0, 1)]
    tokens = [Counter(t for row in rows for t in row["input_ids"].tolist()) for rows in shares]
    assert tokens[0] + tokens[1] == Counter(t for row in whole for t in row["input_ids"].tolist())
    assert tokens[0] != tokens[1]


def test_streaming_needs_max_steps_and_no_workers(tmp_path):
    path = tmp_path / "corpus.jsonl"
    write_text_corpus(path, 4)
    dm = SFTDataModule(dataset=str(path), streaming=True)
    dm.trainer = SimpleNamespace(max_steps=-1, strategy=SimpleNamespace())
    with pytest.raises(ValueError, match=r"set Trainer\(max_steps=...\)"):
        dm.setup("fit")
    with pytest.raises(ValueError, match="set num_workers=0"):
        SFTDataModule(dataset=str(path), streaming=True, num_workers=2)
    with pytest.raises(ValueError, match="give a number of examples"):
        SFTDataModule(dataset=str(path), streaming=True, val_size=0.1)


def test_streamed_validation_holds_out_the_first_examples(tmp_path):
    path = tmp_path / "corpus.jsonl"
    write_text_corpus(path)
    dm = stream_module(path, val_size=10)
    val = [row["input_ids"].tolist() for row in dm.val_dataset]
    in_memory = SFTDataModule(dataset=str(path), max_length=48)
    in_memory.setup("fit")
    assert sorted(val) == sorted(in_memory.train_dataset["input_ids"][:10])
    assert len(list(dm.val_dataloader())) == 2  # 10 examples, batches of 8, one pass


@pytest.mark.parametrize("world", [1, 2, 3])
def test_streamed_validation_examples_are_in_no_rank_s_training_share(tmp_path, world):
    # Two files are two shards: two ranks would each get one, and the hold-out must still be the stream's first rows.
    for name in "ab":
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"text": f"{name}{i} x"}) + "\n" for i in range(10)))

    def texts(module, rows):
        return [module.tokenizer.decode(row["input_ids"], skip_special_tokens=True) for row in rows]

    trained, validated = [], None
    for rank in range(world):
        dm = stream_module(tmp_path, world=world, rank=rank, val_size=5)
        trained += texts(dm, one_pass(dm.train_dataset))
        validated = texts(dm, dm.val_dataset)
    assert sorted(validated) == [f"a{i} x" for i in range(5)]
    assert sorted(trained) == sorted([f"a{i} x" for i in range(5, 10)] + [f"b{i} x" for i in range(10)])


@pytest.mark.parametrize("world", [1, 2])
def test_a_bad_row_after_the_streamed_hold_out_is_named_by_its_own_line(tmp_path, world):
    path = tmp_path / "corpus.jsonl"
    rows = [{"text": f"row {i}"} for i in range(12)]
    rows[8] = {"text": 5}  # line 9
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(ValueError, match=r"corpus.jsonl line 9: 'text': expected text"):
        for rank in range(world):
            one_pass(stream_module(path, world=world, rank=rank, val_size=3).train_dataset)


def test_the_length_profiler_reads_a_sample_of_a_stream(tmp_path):
    path = tmp_path / "corpus.jsonl"
    write_text_corpus(path)
    streamed = SFTDataModule(dataset=str(path), streaming=True, max_length=16).token_lengths(sample=40)
    in_memory = SFTDataModule(dataset=str(path), max_length=16).token_lengths()
    assert len(streamed) == 40 and sorted(streamed) == sorted(in_memory[:40])
    assert in_memory.max() > 16  # measured whole, not truncated
