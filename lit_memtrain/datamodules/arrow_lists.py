"""Arrow list columns (one list of tokens per example): which columns are lists, and how many items each row holds.

Why a module of its own: packing, streaming and the datamodules' token counts all read per-example lengths of
list columns, and they must agree on what a list column is. Lengths come from the offsets of the list arrays
(one subtraction per row), never from the lists themselves, which is what keeps counting a million examples fast.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

__all__ = ["is_list_type", "list_lengths"]


def is_list_type(arrow_type: pa.DataType) -> bool:
    """Whether ``arrow_type`` is a ``list`` or ``large_list``: the types packing reads from their offsets."""
    return pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type)


def list_lengths(column: pa.ChunkedArray) -> np.ndarray:
    """Items per row of a list column (0 for a null row), from the offsets of list chunks without nulls."""
    pieces = [
        np.diff(chunk.offsets.to_numpy()).astype(np.int64, copy=False)
        if not chunk.null_count and is_list_type(chunk.type)
        else pc.list_value_length(chunk).fill_null(0).to_numpy().astype(np.int64)
        for chunk in column.chunks
    ]
    return pieces[0] if len(pieces) == 1 else np.concatenate([np.zeros(0, np.int64), *pieces])
