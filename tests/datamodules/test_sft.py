import itertools
import json
import logging
from collections import Counter

import datasets
import pytest
import torch

from lit_memtrain.datamodules.collate import PaddedCollator
from lit_memtrain.datamodules.embedded import EMBEDDED
from lit_memtrain.datamodules.sft import SFTDataModule
from lit_memtrain.datamodules.tokenizer import load_tokenizer

ROWS = [{"prompt": f"What is {i} + 1?", "completion": f" it is {i + 1}"} for i in range(10)]


def _setup(**kwargs):
    dm = SFTDataModule(**kwargs)
    dm.setup("fit")
    return dm


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet", ".csv"])
def test_loads_local_files(tmp_path, suffix):
    path = tmp_path / f"data{suffix}"
    frame = datasets.Dataset.from_list(ROWS)
    if suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    elif suffix == ".json":
        path.write_text(json.dumps(ROWS))
    elif suffix == ".parquet":
        frame.to_parquet(str(path))
    else:
        frame.to_csv(str(path), index=False)
    dm = _setup(dataset=str(path))
    assert len(dm.train_dataset) == len(ROWS)
    assert dm.train_dataset[3]["input_ids"] == _setup(dataset=datasets.Dataset.from_list(ROWS)).train_dataset[3]["input_ids"]


def test_loads_text_files_as_language_modelling(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("first line of text\nsecond line\n")
    dm = _setup(dataset=str(path))
    assert len(dm.train_dataset) == 2
    assert dm.train_dataset[0]["labels"] == dm.train_dataset[0]["input_ids"]


def test_numbers_in_a_text_column_are_an_error(tmp_path):
    path = tmp_path / "numbers.csv"
    path.write_text("prompt,completion\nWhat is 1 + 1?,2\n")
    with pytest.raises(ValueError, match=r"numbers.csv line 2: 'completion': expected text, got a int value 2"):
        _setup(dataset=str(path))


def test_a_cached_tokenization_is_not_reused_by_other_data_code(tmp_path, monkeypatch):
    """datasets hashes the map function by its name: a new version of the data code (here, masks that train every
    token, and the other source fingerprint that version has) must tokenize again, not load the cached old masks."""
    import datasets.config

    from lit_memtrain.datamodules import sft, tokenize

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    before = _setup(dataset=str(path)).train_dataset[0]
    assert -100 in before["labels"]
    masked = tokenize.tokenize_prompt_completion
    monkeypatch.setattr(
        tokenize, "tokenize_prompt_completion", lambda example, tokenizer, *_: masked(example, tokenizer, False)
    )
    monkeypatch.setattr(sft, "data_code_fingerprint", lambda: "the next version")
    after = _setup(dataset=str(path)).train_dataset[0]
    assert after["input_ids"] == before["input_ids"] and after["labels"] == after["input_ids"]


def test_the_data_code_fingerprint_follows_the_source(tmp_path):
    from lit_memtrain.datamodules.code_fingerprint import data_code_fingerprint

    (tmp_path / "tokenize.py").write_text("MASK = -100\n")
    first = data_code_fingerprint(tmp_path)
    assert data_code_fingerprint(tmp_path) == first
    (tmp_path / "tokenize.py").write_text("MASK = -101\n")
    data_code_fingerprint.cache_clear()
    assert data_code_fingerprint(tmp_path) != first
    assert len(data_code_fingerprint()) == 16


def test_validation_split_and_held_out_size():
    data = datasets.Dataset.from_list(ROWS)
    dm = _setup(dataset=data, val_size=3)
    assert (len(dm.train_dataset), len(dm.val_dataset)) == (7, 3)
    both = datasets.DatasetDict({"train": data, "validation": data.select(range(2))})
    dm = _setup(dataset=both, val_split="validation")
    assert (len(dm.train_dataset), len(dm.val_dataset)) == (10, 2)
    assert _setup(dataset=data).val_dataloader() == []


def test_drops_examples_without_trainable_tokens_and_counts_them():
    rows = ROWS[:4] + [{"prompt": "x " * 50, "completion": " y"}]
    with pytest.warns(UserWarning, match="Dropped 1 of 5 train examples"):
        dm = _setup(dataset=datasets.Dataset.from_list(rows), max_length=20)
    assert dm.num_dropped == 1
    assert len(dm.train_dataset) == 4


def test_empty_after_filtering_is_an_error():
    rows = [{"prompt": "a long prompt " * 20, "completion": " y"}]
    with pytest.raises(ValueError, match="empty after filtering: all 1 examples have no trainable token"):
        _setup(dataset=datasets.Dataset.from_list(rows), max_length=8)


def test_unknown_format_lists_columns_and_formats():
    with pytest.raises(ValueError, match=r"columns \['question'\]. Supported formats: text"):
        _setup(dataset=datasets.Dataset.from_list([{"question": "q"}]))


def test_bad_arguments():
    with pytest.raises(ValueError, match="max_length must be at least 1 token, got 0"):
        SFTDataModule(max_length=0)
    with pytest.raises(ValueError, match="either val_size"):
        SFTDataModule(val_size=0.1, val_split="validation")


def test_chat_data_needs_a_chat_template(tmp_path, tokenizer):
    bare = tmp_path / "bare"
    tokenizer.save_pretrained(str(bare))
    config = json.loads((bare / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    (bare / "chat_template.jinja").unlink(missing_ok=True)
    data = datasets.Dataset.from_list([{"messages": [{"role": "user", "content": "hi"}]}])
    with pytest.raises(ValueError, match="conversational but tokenizer .* has no chat template"):
        _setup(tokenizer=str(bare), dataset=data)


def test_tokenizer_without_pad_token_uses_eos(tmp_path, tokenizer):
    nopad = tmp_path / "nopad"
    tokenizer.save_pretrained(str(nopad))
    config = json.loads((nopad / "tokenizer_config.json").read_text())
    config["pad_token"] = None
    (nopad / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.warns(UserWarning, match="no pad token; using its eos token"):
        loaded = load_tokenizer(str(nopad))
    assert loaded.pad_token_id == loaded.eos_token_id


def test_padded_collation_with_pad_to_multiple_of():
    collate = PaddedCollator(pad_token_id=0, pad_to_multiple_of=8)
    batch = collate([{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"input_ids": list(range(1, 10)), "labels": list(range(1, 10))}])
    assert batch["input_ids"].shape == (2, 16)
    assert batch["input_ids"][0].tolist() == [5, 6, 7] + [0] * 13
    assert batch["labels"][0].tolist() == [-100, 6, 7] + [-100] * 13
    assert batch["attention_mask"].sum(1).tolist() == [3, 9]
    with pytest.raises(ValueError, match="pad_to_multiple_of"):
        PaddedCollator(0, pad_to_multiple_of=0)


def test_embedded_dataloader_batches():
    dm = _setup(tokenizer=EMBEDDED, dataset=EMBEDDED, max_length=64, batch_size=4, pad_to_multiple_of=16)
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].shape[0] == 4 and batch["input_ids"].shape[1] % 16 == 0
    assert torch.all((batch["labels"] == -100) | (batch["labels"] == batch["input_ids"]))


# --- every token accounted for, through the datamodule (issue 13, point 1) -----------------------------------------

MAX_LENGTH = 64


def text_rows(count: int = 60, seed: int = 0) -> list[dict[str, str]]:
    """Text examples of 5 to 400 words: most are several times longer than MAX_LENGTH tokens."""
    import random
    import string

    rng = random.Random(seed)
    words = ["".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 8))) for _ in range(300)]
    return [{"text": " ".join(rng.choice(words) for _ in range(rng.randint(5, 400)))} for _ in range(count)]


def reference_ids(tokenizer, rows):
    """What each text example tokenizes to, whole: its tokens, then eos (the embedded tokenizer adds no BOS)."""
    return [tokenizer(row["text"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for row in rows]


def documents(dataset):
    """Every document of every packed row, as a tuple of token ids."""
    found = []
    for ids, lengths in zip(dataset["input_ids"], dataset["seq_lengths"]):
        bounds = [0, *itertools.accumulate(lengths)]
        found += [tuple(ids[a:b]) for a, b in itertools.pairwise(bounds)]
    return found


@pytest.mark.parametrize("strategy", [None, "bfd", "bfd_split", "wrapped"])
def test_every_token_is_accounted_for_with_examples_longer_than_max_length(tokenizer, caplog, strategy):
    rows = text_rows()
    examples = reference_ids(tokenizer, rows)
    total = sum(map(len, examples))
    overflow = sum(max(len(ids) - MAX_LENGTH, 0) for ids in examples)
    assert max(map(len, examples)) > 10 * MAX_LENGTH and overflow > total / 2
    with caplog.at_level(logging.INFO):
        dm = _setup(
            dataset=datasets.Dataset.from_list(rows), max_length=MAX_LENGTH, packing=strategy is not None,
            packing_strategy=strategy or "bfd",
        )
    counts = dm.token_counts["train"]
    assert (counts.examples, counts.tokens, counts.dropped_examples) == (len(rows), total, 0)
    packed = dm.train_dataset["input_ids"]
    assert max(map(len, packed)) <= MAX_LENGTH
    if strategy in ("bfd_split", "wrapped"):
        assert dm.num_truncated_tokens == 0 and counts.kept_tokens == total
        assert Counter(t for row in packed for t in row) == Counter(t for ids in examples for t in ids)
        if strategy == "wrapped":  # the examples, concatenated in order and cut into blocks
            assert [t for row in packed for t in row] == [t for ids in examples for t in ids]
        else:  # each example cut into consecutive chunks of MAX_LENGTH tokens, each its own document
            chunks = [tuple(ids[i : i + MAX_LENGTH]) for ids in examples for i in range(0, len(ids), MAX_LENGTH)]
            assert Counter(documents(dm.train_dataset)) == Counter(chunks)
    else:
        assert dm.num_truncated_tokens == overflow and counts.kept_tokens == total - overflow
        heads = [tuple(ids[:MAX_LENGTH]) for ids in examples]
        if strategy == "bfd":
            assert Counter(documents(dm.train_dataset)) == Counter(heads)
        else:
            assert [tuple(ids) for ids in packed] == heads
        assert f"{overflow:,} (" in caplog.text and f"truncated past max_length={MAX_LENGTH}" in caplog.text
        assert "dropped examples" not in caplog.text  # none is dropped: no "0 in 0 dropped examples"


# --- clear errors naming the file and line (issue 13, point 6) -----------------------------------------------------


def test_a_jsonl_line_that_is_not_json_is_named(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text('{"text": "a"}\n\n{"text": "b", oops}\n{"text": "c"}\n')
    with pytest.raises(ValueError, match=r"broken.jsonl:3:15: not valid JSON \(Expecting property name"):
        _setup(dataset=str(path))
    with pytest.raises(ValueError, match=r"broken.jsonl:3:15: not valid JSON"):
        list(_setup(dataset=str(path), streaming=True, buffer_size=1).train_dataset)


@pytest.mark.parametrize("streaming", [False, True])
def test_a_row_missing_a_column_is_named(tmp_path, streaming):
    path = tmp_path / "pairs.jsonl"
    path.write_text('{"prompt": "What is 1 + 1?", "completion": " 2"}\n\n{"prompt": "What is 2 + 2?"}\n')
    with pytest.raises(ValueError, match=r"pairs.jsonl line 3: the row has no 'completion' value"):
        dm = _setup(dataset=str(path), streaming=streaming)
        list(dm.train_dataset)


@pytest.mark.parametrize("streaming", [False, True])
def test_a_message_without_role_is_named(tmp_path, streaming):
    path = tmp_path / "chats.jsonl"
    rows = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
            {"messages": [{"content": "hi"}, {"role": "assistant", "content": "hello"}]}]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(ValueError, match=r"chats.jsonl line 2: 'messages': message 0 has no 'role'"):
        dm = _setup(dataset=str(path), streaming=streaming)
        list(dm.train_dataset)


def test_an_empty_dataset_after_filtering_names_the_file(tmp_path):
    path = tmp_path / "long_prompts.csv"
    datasets.Dataset.from_list([{"prompt": "a long prompt " * 20, "completion": " y"}]).to_csv(str(path), index=False)
    with pytest.raises(ValueError, match=r"train dataset \(from .*long_prompts.csv\) is empty after filtering"):
        _setup(dataset=str(path), max_length=8)


def test_a_csv_row_and_a_missing_column_are_named(tmp_path):
    path = tmp_path / "questions.csv"
    path.write_text("question,answer\nWhat is 1 + 1?,2\n")
    with pytest.raises(ValueError, match=r"train split \(from .*questions.csv\): Cannot tell the dataset format"):
        _setup(dataset=str(path))


def test_the_datamodule_imports_without_pyarrow_datasets_or_llvmlite():
    """GPU machines may lack them: they are imported when data is read, streamed or packed."""
    import subprocess
    import sys

    code = (
        "import sys, lit_memtrain.datamodules.sft, lit_memtrain.datamodules.resumable;"
        "print(sorted(m for m in ('datasets', 'pyarrow', 'llvmlite') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize(
    ("content", "shown"),
    [(5, "int: 5"), ([5], "list: [5]"), ([{"type": "text", "text": 5}], "list: [{'type': 'text', 'text': 5}]")],
    ids=["number", "list-of-numbers", "text-part-of-a-number"],
)
@pytest.mark.parametrize("streaming", [False, True])
def test_chat_content_that_is_not_text_is_named_with_its_field_and_line(tmp_path, streaming, content, shown):
    path = tmp_path / "chats.jsonl"
    rows = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
            {"messages": [{"role": "user", "content": "2 + 3?"}, {"role": "assistant", "content": content}]}]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(ValueError) as raised:
        list(_setup(dataset=str(path), streaming=streaming).train_dataset)
    assert str(raised.value) == (
        f"{path} line 2: 'messages': the 'content' of message 1 ('assistant') is not text ({shown}); write it as a "
        "string."
    )


def test_examples_dropped_because_their_answers_lie_past_max_length_count_as_cut_tokens(tmp_path):
    path = tmp_path / "long_prompts.jsonl"
    rows = [{"prompt": "Say it." + " word" * 40, "completion": " done"}] * 3 + [{"prompt": "Hi.", "completion": " yo"}]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.warns(UserWarning) as warned:
        dm = _setup(dataset=str(path), max_length=16)
    counts = dm.token_counts["train"]
    assert counts.dropped_examples == 3 and counts.truncated_tokens == 0  # the long rows are dropped, not cut
    message = next(str(w.message) for w in warned if "cut past max_length" in str(w.message))
    assert message.startswith(
        f"train: {100 * counts.dropped_tokens / counts.tokens:.1f}% of the tokens ({counts.dropped_tokens:,} of "
        f"{counts.tokens:,}) are cut past max_length=16. Keep them with a larger --data.max_length"
    )


@pytest.mark.parametrize("streaming", [False, True])
def test_an_empty_data_file_is_named(tmp_path, streaming):
    path = tmp_path / "chats.jsonl"
    path.write_text("\n \n")
    with pytest.raises(ValueError) as raised:
        _setup(dataset=str(path), streaming=streaming)
    assert str(raised.value) == (
        f"{path} is empty: it holds no examples. Give a file with one example per line (JSON lines), or remove it "
        "from data_files."
    )


def test_truncation_dropping_more_than_a_tenth_of_the_tokens_warns_naming_the_options_that_keep_them(tmp_path):
    path = tmp_path / "long.jsonl"
    rows = [{"prompt": "Say it.", "completion": " word" * 200}, {"prompt": "Hi.", "completion": " hello"}]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.warns(UserWarning) as warned:
        dm = _setup(dataset=str(path), max_length=16)
    counts = dm.token_counts["train"]
    message = next(str(w.message) for w in warned if "cut past max_length" in str(w.message))
    share = 100 * counts.truncated_tokens / counts.tokens
    assert share > 80 and message == (
        f"train: {share:.1f}% of the tokens ({counts.truncated_tokens:,} of {counts.tokens:,}) are cut past "
        "max_length=16. Keep them with a larger --data.max_length (lit-memtrain lengths recommends one), or "
        "--data.packing=true --data.packing_strategy=bfd_split (long examples split into chunks that all train)."
    )
