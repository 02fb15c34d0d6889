"""The training and validation splits of a datamodule: argument checks, split selection and hold-out.

Why shared: SFT and preference data choose their splits the same way (a named split to train on, and either
a named validation split or part of the training split held out with a fixed seed), so the rules and their
error messages live in one place and the two datamodules cannot drift apart.
"""

from __future__ import annotations

from typing import Any

from lit_memtrain.datamodules.sources import RawData, load_raw_dataset

__all__ = ["check_validation_args", "hold_out", "load_splits"]


def check_validation_args(val_size: float, val_split: str | None) -> None:
    """Refuse a negative ``val_size``, or ``val_size`` and ``val_split`` together (one validation source)."""
    if val_size < 0:
        raise ValueError(f"val_size must be >= 0 (a fraction below 1 or a count), got {val_size}.")
    if val_size and val_split:
        raise ValueError("Give either val_size (hold out part of the training split) or val_split, not both.")


def load_splits(
    dataset: Any,
    dataset_config: str | None,
    data_files: str | list[str] | dict[str, Any] | None,
    split: str,
    val_split: str | None,
    streaming: bool = False,
    val_split_label: str = "val_split",
) -> tuple[RawData, Any, Any]:
    """The raw dataset, its ``split`` and its ``val_split`` (None when not given), in memory or streamed.

    A missing split is an error naming the splits there are; ``val_split_label`` is how that error names a
    missing ``val_split``.
    """
    import datasets

    raw = load_raw_dataset(dataset, dataset_config, data_files, streaming=streaming)
    data, val = raw.data, None
    if isinstance(data, (datasets.DatasetDict, datasets.IterableDatasetDict)):
        if split not in data:
            raise ValueError(f"Split {split!r} not found; the dataset has splits {list(data)}.")
        if val_split is not None:
            if val_split not in data:
                raise ValueError(f"{val_split_label} {val_split!r} not found; the dataset has splits {list(data)}.")
            val = data[val_split]
        data = data[split]
    elif val_split is not None:
        raise ValueError(f"val_split={val_split!r} was given but the dataset has a single split.")
    return raw, data, val


def hold_out(train: Any, val_size: float, seed: int, unit: str) -> tuple[Any, Any]:
    """``(train, validation)``: ``val_size`` (a fraction below 1, or a count) of ``train`` held out with ``seed``.

    A count that would leave no training data is an error; ``unit`` names the rows in it (``"examples"``).
    """
    size = val_size if val_size < 1 else int(val_size)
    if isinstance(size, int) and size >= len(train):
        raise ValueError(f"val_size={val_size} leaves no training data out of {len(train)} {unit}.")
    parts = train.train_test_split(test_size=size, seed=seed)
    return parts["train"], parts["test"]
