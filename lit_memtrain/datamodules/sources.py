"""Loading raw data (in memory or streamed) and saying where a bad row is: file, line and column.

Why: ``datasets`` reports a broken JSON line as "An error occurred while generating the dataset" and a row
missing a column as a ``None`` deep inside tokenization. A user with a million-line JSONL file needs the
file and the line. Rows are located only when something is wrong, by reading the files again, so loading
costs nothing extra.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lit_memtrain.datamodules.embedded import EMBEDDED, embedded_dataset_path, named_dataset_file
from lit_memtrain.datamodules.hub_access import require_hub

if TYPE_CHECKING:
    from datasets import Dataset, DatasetDict, IterableDataset, IterableDatasetDict

FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".txt": "text"}


@dataclass(frozen=True)
class RowLocator:
    """Names where row ``index`` of a split comes from: ``data.jsonl line 12`` for local files, else
    ``row 12 of the train split``.

    ``files`` are the split's local data files in load order (empty when the data did not come from local
    files or cannot be told apart). ``step`` and ``offset`` describe a stream split across ranks by taking
    every ``step``-th row from ``offset``: local row ``i`` is row ``offset + i * step`` of the files.
    """

    files: tuple[str, ...] = ()
    split: str = "the train split"
    step: int = 1
    offset: int = 0

    def __call__(self, index: int) -> str:
        row = self.offset + index * self.step
        for path in self.files:
            position, count = _position_in_file(path, row)
            if position is not None:
                return f"{path} {position}"
            row -= count
        return f"row {self.offset + index * self.step + 1} of {self.split}"


def _position_in_file(path: str, row: int) -> tuple[str | None, int]:
    """(``"line L"`` or ``"row R"`` of ``row`` in ``path`` if it holds that many rows, rows in the file)."""
    suffix = Path(path).suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        rows = pq.ParquetFile(path).metadata.num_rows
        return (f"row {row + 1}" if row < rows else None), rows
    with open(path, newline="" if suffix == ".csv" else None, encoding="utf-8", errors="replace") as lines:
        if suffix == ".csv":
            reader = csv.reader(lines)
            next(reader, None)  # header
            count = 0
            for count, _ in enumerate(reader, start=1):
                if count - 1 == row:
                    return f"line {reader.line_num}", count
            return None, count
        if suffix == ".json" and _is_json_document(path):
            rows = len(json.loads(Path(path).read_text(encoding="utf-8")))
            return (f"item {row + 1}" if row < rows else None), rows
        count = 0
        for line_number, line in enumerate(lines, start=1):
            if suffix == ".txt" or line.strip():  # the JSON reader skips blank lines, the text reader keeps them
                if count == row:
                    return f"line {line_number}", count + 1
                count += 1
        return None, count


def _is_json_document(path: str) -> bool:
    """A ``.json`` file holding one array (rather than one object per line)."""
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.strip():
                return line.lstrip().startswith("[")
    return False


def _is_blank(path: str) -> bool:
    """Whether a file holds nothing but white space (read up to its first other byte)."""
    with open(path, "rb") as file:
        while chunk := file.read(1 << 16):
            if chunk.strip():
                return False
    return True


def find_invalid_json(path: str) -> str | None:
    """``"path:line:column: <reason>"`` for the first line of a JSON-lines file (or a JSON file) that does not
    parse, or None when the file is valid."""
    if _is_json_document(path):
        try:
            json.loads(Path(path).read_text(encoding="utf-8"))
        except json.JSONDecodeError as error:
            return f"{path}:{error.lineno}:{error.colno}: not valid JSON ({error.msg})"
        return None
    with open(path, encoding="utf-8", errors="replace") as lines:
        for line_number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as error:
                return f"{path}:{line_number}:{error.colno}: not valid JSON ({error.msg})"
            if not isinstance(value, dict):
                return f"{path}:{line_number}:1: expected a JSON object per line, found a {type(value).__name__}"
    return None


def raise_for_invalid_json(files: tuple[str, ...], error: BaseException) -> None:
    """Re-raise a loading ``error`` as a ValueError naming the file, line and column of the bad JSON, if any."""
    for path in files:
        if Path(path).suffix.lower() in (".json", ".jsonl"):
            problem = find_invalid_json(path)
            if problem:
                raise ValueError(f"{problem}. Fix or remove that line.") from error


@dataclass(frozen=True)
class RawData:
    """A loaded dataset (or streaming dataset) and the local files it came from, per split."""

    data: Any
    files: dict[str, tuple[str, ...]]

    def locator(self, split: str) -> RowLocator:
        return RowLocator(self.files.get(split, ()), f"the {split} split")

    def describe(self, split: str) -> str:
        files = self.files.get(split, ())
        return f" (from {', '.join(files)})" if files else ""


def _local_files(dataset: str, data_files: str | list[str] | dict[str, Any] | None) -> dict[str, tuple[str, ...]]:
    """The local data files per split, when they can be known without loading."""
    if dataset == EMBEDDED:
        return {"train": (embedded_dataset_path(),)}
    if Path(dataset).is_file():
        return {"train": (str(dataset),)}
    if isinstance(data_files, (str, list)):
        data_files = {"train": data_files}
    if isinstance(data_files, dict):
        files = {}
        for split, paths in data_files.items():
            paths = (paths,) if isinstance(paths, str) else tuple(paths)
            if all(Path(path).is_file() for path in paths):
                files[split] = tuple(str(path) for path in paths)
        return files
    return {}


def load_raw_dataset(
    dataset: str | Dataset | DatasetDict | IterableDataset | IterableDatasetDict,
    dataset_config: str | None = None,
    data_files: str | list[str] | dict[str, Any] | None = None,
    streaming: bool = False,
) -> RawData:
    """Load a hub dataset name, a local file (jsonl, json, parquet, csv, txt), a directory, an embedded named set
    (:func:`~lit_memtrain.datamodules.embedded.named_dataset_file`), or pass a dataset through.

    With ``streaming`` the result reads its rows lazily (a ``datasets.IterableDataset`` per split): an
    in-memory dataset is turned into one, a ``save_to_disk`` directory is read from its Arrow files.
    A JSON file that does not parse raises a ValueError naming its file, line and column; a local file that is not
    there (a name with a data file's suffix, or a path) a FileNotFoundError.
    """
    import datasets

    if isinstance(dataset, (datasets.Dataset, datasets.DatasetDict)):
        if streaming:
            if isinstance(dataset, datasets.Dataset):
                return RawData(dataset.to_iterable_dataset(), {})
            return RawData(datasets.IterableDatasetDict({k: v.to_iterable_dataset() for k, v in dataset.items()}), {})
        return RawData(dataset, {})
    if isinstance(dataset, (datasets.IterableDataset, datasets.IterableDatasetDict)):
        if not streaming:
            raise ValueError("An IterableDataset was given: set streaming=True to read it as a stream.")
        return RawData(dataset, {})
    dataset = named_dataset_file(dataset)
    files = _local_files(dataset, data_files)
    for path in (path for split_files in files.values() for path in split_files if _is_blank(path)):
        raise ValueError(
            f"{path} is empty: it holds no examples. Give a file with one example per line (JSON lines), or "
            "remove it from data_files."
        )
    path = Path(embedded_dataset_path() if dataset == EMBEDDED else dataset)
    missing = _missing_file(dataset)
    if missing is not None and not _hub_shaped(dataset):
        raise missing
    try:
        if path.is_file():
            builder = FILE_BUILDERS.get(path.suffix.lower())
            if builder is None:
                raise ValueError(
                    f"Cannot load {dataset!r}: unknown file type {path.suffix!r}. Supported: {', '.join(FILE_BUILDERS)}."
                )
            loaded = datasets.load_dataset(builder, data_files=str(path), streaming=streaming)
        elif path.is_dir() and ((path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists()):
            loaded = datasets.load_from_disk(str(path))
            if streaming:
                if isinstance(loaded, datasets.Dataset):
                    loaded = loaded.to_iterable_dataset()
                else:
                    loaded = datasets.IterableDatasetDict({k: v.to_iterable_dataset() for k, v in loaded.items()})
        else:
            if _hub_shaped(dataset):  # not a builder name (json, parquet...) with data_files
                require_hub(dataset, "dataset", repo_type="dataset")
            loaded = datasets.load_dataset(dataset, dataset_config, data_files=data_files, streaming=streaming)
    except Exception as error:  # noqa: BLE001 - re-raised, with the bad JSON line or the missing file
        raise_for_invalid_json(tuple(f for split_files in files.values() for f in split_files), error)
        if missing is not None:
            raise missing from error
        raise
    return RawData(loaded, files)


def _missing_file(dataset: str) -> FileNotFoundError | None:
    """The error for ``dataset`` when it names a local file that is not there, else None.

    Why: ``datasets`` tries a name it cannot find on disk as a Hub dataset, so a mistyped ``my_chats.jsonl`` ends in
    "Couldn't reach 'my_chats.jsonl' on the Hub (LocalEntryNotFoundError)", after retries when online. A name with
    a data file's suffix, or written as a path (``./``, ``../``, ``/``, ``~``), is a local file.
    """
    path = Path(dataset).expanduser()
    if path.exists() or not (path.suffix.lower() in FILE_BUILDERS or dataset.startswith(("./", "../", "/", "~"))):
        return None
    return FileNotFoundError(
        f"dataset {dataset!r}: no such file ({path.absolute()} does not exist). Check the path, relative to the "
        "directory the command runs in."
    )


def _hub_shaped(dataset: str) -> bool:
    """``owner/name``, as a Hub dataset is named (``data/chats.jsonl`` too: tried on the Hub before it is called
    missing)."""
    return dataset.count("/") == 1 and not dataset.startswith((".", "/", "~"))
