"""Where a bad row is: RowLocator and find_invalid_json on the file types the datamodule loads."""

from __future__ import annotations

import json

import datasets

from lit_memtrain.datamodules.sources import RowLocator, find_invalid_json


def test_rows_are_located_by_file_and_line(tmp_path):
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    first.write_text('{"text": "0"}\n\n{"text": "1"}\n')
    second.write_text('{"text": "2"}\n{"text": "3"}\n')
    loaded = datasets.load_dataset("json", data_files=[str(first), str(second)])["train"]
    assert loaded["text"] == ["0", "1", "2", "3"]  # blank lines are skipped, files read in order
    locate = RowLocator((str(first), str(second)))
    assert [locate(row) for row in range(4)] == [f"{first} line 1", f"{first} line 3", f"{second} line 1", f"{second} line 2"]
    assert RowLocator((str(first), str(second)), step=2, offset=1)(1) == f"{second} line 2"  # rank 1 of 2: rows 1, 3
    assert RowLocator()(4) == "row 5 of the train split"


def test_csv_parquet_json_and_text_rows(tmp_path):
    rows = [{"text": "a,b"}, {"text": "line\nbreak"}, {"text": "c"}]
    csv, parquet, document, text = (tmp_path / f"data.{kind}" for kind in ("csv", "parquet", "json", "txt"))
    datasets.Dataset.from_list(rows).to_csv(str(csv), index=False)
    datasets.Dataset.from_list(rows).to_parquet(str(parquet))
    document.write_text(json.dumps(rows, indent=1))
    text.write_text("a\n\nb\n")
    assert RowLocator((str(csv),))(2) == f"{csv} line 5"  # the quoted line break takes two lines
    assert RowLocator((str(parquet),))(2) == f"{parquet} row 3"
    assert RowLocator((str(document),))(1) == f"{document} item 2"
    assert RowLocator((str(text),))(2) == f"{text} line 3"  # the text reader keeps blank lines


def test_invalid_json_is_found_with_line_and_column(tmp_path):
    lines, document = tmp_path / "rows.jsonl", tmp_path / "rows.json"
    lines.write_text('{"a": 1}\n\n{"a": 2,}\n')
    assert find_invalid_json(str(lines)) == f"{lines}:3:9: not valid JSON (Expecting property name enclosed in double quotes)"
    lines.write_text('{"a": 1}\n[1, 2]\n')
    assert find_invalid_json(str(lines)) == f"{lines}:2:1: expected a JSON object per line, found a list"
    document.write_text('[\n  {"a": 1},\n  {"a" 2}\n]\n')
    assert find_invalid_json(str(document)) == f"{document}:3:8: not valid JSON (Expecting ':' delimiter)"
    document.write_text('[{"a": 1}]')
    assert find_invalid_json(str(document)) is None
