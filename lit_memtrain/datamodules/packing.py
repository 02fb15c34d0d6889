"""Pack a tokenised dataset into rows of at most ``max_length`` tokens, globally and fast.

Why: padding a batch to its longest example wastes compute and memory on pad tokens; packing
several examples into one row (and keeping each document's length in ``seq_lengths`` so position
ids restart per document) wastes almost none. TRL packs each ``datasets.map`` batch of 1000 rows
separately with a pure-Python segment tree: slow, and the packing is only as full as a 1000-row
batch allows. Here the plan is made once over the whole dataset
(:mod:`~lit_memtrain.datamodules.packing_plan`, where the strategies are described), and each column
is copied into the planned rows by a compiled loop (:mod:`~lit_memtrain.datamodules.table_packing`),
never with a Python loop per token or per example. A stream is packed a window at a time
(:mod:`~lit_memtrain.datamodules.streaming`).

Usage::

    from lit_memtrain.datamodules.packing import pack_dataset

    packed = pack_dataset(tokenised, max_length=2048, strategy="bfd")
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

from lit_memtrain.datamodules.packing_plan import check_max_length, check_strategy
from lit_memtrain.datamodules.table_packing import list_columns, pack_table

if TYPE_CHECKING:  # datasets is imported only when a dataset is packed
    from datasets import Dataset, IterableDataset

__all__ = ["pack_dataset"]


def pack_dataset(
    dataset: Dataset | IterableDataset, max_length: int, strategy: str = "bfd", buffer_size: int = 1000
) -> Dataset | IterableDataset:
    """Pack every list column of ``dataset`` into rows of at most ``max_length`` tokens.

    Same contract as ``trl.pack_dataset``: all list columns (``input_ids``, ``labels``, masks)
    are packed together and must have the same length per example; non-list columns are
    dropped; ``"bfd"`` and ``"bfd_split"`` add ``seq_lengths``, the length of each document in a
    row. The plan is global over the dataset (not per ``map`` batch) and the output keeps the
    dataset's format. With ``"bfd"`` / ``"bfd_split"`` shuffle the packed rows (the plan sorts by
    length, so shuffling before only reorders ties); with ``"wrapped"`` shuffle before packing.

    A ``datasets.IterableDataset`` is packed on the fly, ``buffer_size`` examples at a time, into a
    ``datasets.IterableDataset`` of rows, as ``trl.pack_dataset`` returns one (so ``.batch``, ``.map``,
    ``.shuffle`` work on it): host memory stays flat however long the stream
    (:func:`~lit_memtrain.datamodules.streaming.pack_iterable_dataset`).
    """
    check_max_length(max_length)
    check_strategy(strategy)
    import datasets

    if isinstance(dataset, datasets.IterableDataset):
        from lit_memtrain.datamodules.streaming import pack_iterable_dataset

        return pack_iterable_dataset(dataset, max_length, strategy, buffer_size)
    schema = dataset.data.schema
    packed_names = list_columns(schema)
    if dataset._indices is None:  # not selected or shuffled: its table holds its rows, as they are
        table = dataset.data.table.select(packed_names)
    else:
        table = dataset.select_columns(packed_names).with_format("arrow")[:]
    packed_table = pack_table(table, max_length, strategy)
    from datasets import DatasetInfo, Features

    features = Features.from_arrow_schema(packed_table.schema)
    features.update({name: dataset.features[name] for name in packed_names})
    fingerprint = hashlib.sha256(
        f"{dataset._fingerprint}|pack_dataset|{max_length}|{strategy}".encode()
    ).hexdigest()[:16]
    packed = datasets.Dataset(packed_table, info=DatasetInfo(features=features), fingerprint=fingerprint)
    return _with_same_format(packed, dataset.format)


def _with_same_format(packed: Dataset, dataset_format: dict) -> Dataset:
    columns = dataset_format.get("columns")
    if columns is not None:
        columns = [name for name in columns if name in packed.column_names]
        if "seq_lengths" in packed.column_names:
            columns.append("seq_lengths")
    same_format = {
        "type": dataset_format.get("type"),
        "format_kwargs": dataset_format.get("format_kwargs", {}),
        "columns": packed.column_names if columns is None else columns,
        "output_all_columns": dataset_format.get("output_all_columns", False),
    }
    if packed.format == same_format:  # the default format: no new fingerprint to hash
        return packed
    return packed.with_format(
        same_format["type"],
        columns=columns,
        output_all_columns=same_format["output_all_columns"],
        **same_format["format_kwargs"],
    )
