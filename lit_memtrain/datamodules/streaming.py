"""Pack a stream of examples on the fly, a window at a time, with host memory that stays flat.

Why: a long-context corpus (books concatenated to a million tokens) does not fit in RAM, and a packed
table costs about 12 bytes per token. Here rows are made from a window of ``buffer_size`` examples read
from a ``datasets.IterableDataset``: the window is tokenized (optionally), planned with the same
Best-Fit Decreasing as :func:`~lit_memtrain.datamodules.packing.pack_dataset` and copied into rows.
Only one window lives in memory. The least full row of each window is not emitted: its documents are
carried into the next window, where smaller documents fill it (for ``"wrapped"`` the carry is the
unfinished last block). Without that carry, the last rows of every window would be half empty; with it
the fill is within a few hundredths of a point of the global plan (see ``benchmarks/packing.py``).

Exact resume: the position after each row is ``(pass, window, source state at the window's start, carry
into the window, rows already emitted)``, made of plain Python values. Loading it re-reads that one
window (``datasets`` restores the source's position), re-plans it (the plan is deterministic) and
skips the rows already emitted, so a resumed stream yields exactly the rows an uninterrupted one would.
Rows are shuffled within each window by a generator seeded with ``(seed, pass, window)``.

``SFTDataModule(streaming=True)`` reads a :class:`PackedStream` (with that resume); ``pack_dataset`` of a
``datasets.IterableDataset`` gives the same rows as a ``datasets.IterableDataset``, as TRL does
(:func:`pack_iterable_dataset`).

Usage::

    packed = pack_dataset(tokenized.to_iterable_dataset(), max_length=4096, buffer_size=1000)
    loader = DataLoader(packed, batch_size=1, collate_fn=PaddingFreeCollator())
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from lit_memtrain.datamodules.arrow_lists import is_list_type, list_lengths
from lit_memtrain.datamodules.packing_plan import check_max_length, check_strategy
from lit_memtrain.datamodules.sources import raise_for_invalid_json
from lit_memtrain.datamodules.table_packing import list_columns, pack_table
from lit_memtrain.datamodules.tokenize import TokenCounts

if TYPE_CHECKING:
    from datasets import IterableDataset


@dataclass
class TokenizedWindow:
    """A window after tokenization: list columns in ``table`` (one example per row) and what was dropped."""

    table: pa.Table
    counts: TokenCounts = field(default_factory=TokenCounts)


class PackedStream(torch.utils.data.IterableDataset):
    """Rows packed on the fly from a ``datasets.IterableDataset``, ``buffer_size`` examples at a time.

    Each row is a dict of int numpy arrays: ``input_ids``, ``labels`` (and any other list column) and,
    for ``"bfd"`` / ``"bfd_split"``, ``seq_lengths``. With ``strategy=None`` the examples are yielded one
    by one, cut to ``max_length``, without packing (still shuffled within the window).

    Args:
        source: the stream of examples: tokenized (list columns such as ``input_ids``) or raw, with
            ``tokenize`` given.
        max_length: tokens per row.
        strategy: ``"bfd"``, ``"bfd_split"``, ``"wrapped"`` (as :func:`pack_dataset`) or None.
        buffer_size: examples per window; memory is about ``buffer_size`` x mean tokens x 16 bytes
            (the window and its packed rows, int32 ids and labels), plus the raw examples.
        tokenize: turns a window of raw rows (a dict of columns) and the index of its first example
            into a :class:`TokenizedWindow`; None reads the source's list columns as they are.
        shuffle: shuffle the rows within each window.
        seed: seed of that shuffle.
        repeat: start again at the end of the stream, for ever (training for ``max_steps``).
        on_pass_end: called with the :class:`TokenCounts` of each finished pass (for logging).
        files: the local files the source reads: a JSON line that does not parse is then reported with
            its file, line and column.

    Example:
        >>> stream = PackedStream(tokenized_stream, max_length=2048, strategy="bfd_split", buffer_size=1000)
        >>> state = stream.state_dict()  # after some rows; stream.load_state_dict(state) resumes there
    """

    def __init__(
        self,
        source: IterableDataset,
        max_length: int,
        strategy: str | None = "bfd",
        buffer_size: int = 1000,
        tokenize: Callable[[dict[str, list], int], TokenizedWindow] | None = None,
        shuffle: bool = True,
        seed: int = 0,
        repeat: bool = False,
        on_pass_end: Callable[[TokenCounts], None] | None = None,
        files: tuple[str, ...] = (),
    ) -> None:
        check_max_length(max_length)
        if strategy is not None:
            check_strategy(strategy)
        if isinstance(buffer_size, bool) or not isinstance(buffer_size, int) or buffer_size < 1:
            raise ValueError(f"buffer_size must be an integer >= 1 (examples per window), got {buffer_size!r}.")
        self.source = source if tokenize is not None else source.with_format("arrow")
        self.max_length = max_length
        self.strategy = strategy
        self.buffer_size = buffer_size
        self.tokenize = tokenize
        self.shuffle = shuffle
        self.seed = seed
        self.repeat = repeat
        self.on_pass_end = on_pass_end
        self.files = files
        self.counts = TokenCounts()
        self._position = _start_position(0)
        self._resume: dict[str, Any] | None = None

    @property
    def layout(self) -> dict[str, Any]:
        """How the stream cuts, packs and orders its rows (a saved position points at the same rows only under it)."""
        return {
            "max_length": self.max_length, "strategy": self.strategy, "buffer_size": self.buffer_size,
            "seed": self.seed, "shuffle": self.shuffle,
        }

    def state_dict(self) -> dict[str, Any]:
        """Where the stream is: just after the last row it yielded (plain Python values)."""
        return copy.deepcopy(self._position)

    @property
    def current_position(self) -> dict[str, Any]:
        """The position after the last row yielded, without a copy: a new dict after each row, never changed."""
        return self._position

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Make the next iteration start just after the row at which ``state`` was taken."""
        missing = set(_start_position(0)) - set(state)
        if missing:
            raise ValueError(f"Not a PackedStream state: missing {sorted(missing)}.")
        self._resume = copy.deepcopy(state)
        self._position = copy.deepcopy(state)

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        if torch.utils.data.get_worker_info() is not None:
            raise RuntimeError(
                "PackedStream reads one stream in order and cannot be split across DataLoader workers; "
                "use num_workers=0 (tokenization and packing then run in the training process)."
            )
        yield from self._passes()

    def _passes(self) -> Iterator[dict[str, np.ndarray]]:
        """The rows from where the stream stands, pass after pass when it repeats."""
        position, self._resume = self._resume or _start_position(0), None
        while True:
            rows = 0
            for row in self._one_pass(position):
                rows += 1
                yield row
            if self.on_pass_end is not None:
                self.on_pass_end(self.counts)
            if not self.repeat:
                return
            if not rows and position == _start_position(position["pass"]):  # would read empty passes for ever
                raise ValueError(
                    f"The stream gave no row in a whole pass ({self.counts.examples} examples read, "
                    f"{self.counts.dropped_examples} of them dropped with nothing to train), so repeating it would "
                    "never give a batch. With several data-parallel ranks, each rank reads its own share: give every "
                    "rank at least one example with a trainable token."
                )
            position = _start_position(position["pass"] + 1)

    def _one_pass(self, position: dict[str, Any]) -> Iterator[dict[str, np.ndarray]]:
        """Rows from ``position`` to the end of its pass, each window planned, packed and shuffled alone."""
        pass_index, window_index = position["pass"], position["window"]
        if window_index == 0 and position["rows_done"] == 0:
            self.counts = TokenCounts()
        source = _fresh_view(self.source)
        source.set_epoch(pass_index)
        if position["source"] is not None:
            source.load_state_dict(position["source"])
        windows = source.iter(batch_size=self.buffer_size)
        window_start, carry, skip, examples = (
            position["source"], position["carry"], position["rows_done"], position["examples"]
        )
        while True:
            try:
                raw = next(windows, None)
            except Exception as error:  # noqa: BLE001 - re-raised, with the bad JSON line when there is one
                raise_for_invalid_json(self.files, error)
                raise
            if raw is None and carry is None:
                return
            after = source.state_dict()
            table, counts = self._window_table(raw, examples)
            rows, order, carry_out, truncated = self._pack(table, carry, final=raw is None, seed=(pass_index, window_index))
            counts.truncated_tokens += truncated
            counts.kept_tokens -= truncated
            if skip == 0:
                self.counts.add(counts)
            for done in range(skip, len(order)):
                self._position = {
                    "pass": pass_index,
                    "window": window_index,
                    "source": window_start,
                    "examples": examples,
                    "carry": carry,
                    "rows_done": done + 1,
                }
                index = int(order[done])
                yield {name: rows.column(name)[index].values.to_numpy(zero_copy_only=False).copy() for name in rows.column_names}
            window_start, examples, carry, skip = after, examples + counts.examples, carry_out, 0
            window_index += 1

    def _window_table(self, raw: Any, first_index: int) -> tuple[pa.Table | None, TokenCounts]:
        """The window's examples as list columns, and what reading them kept and dropped."""
        if raw is None:
            return None, TokenCounts()
        if self.tokenize is not None:
            window = self.tokenize(raw, first_index)
            return window.table, window.counts
        names = [name for name in raw.column_names if is_list_type(raw.schema.field(name).type)]
        if not names:
            raise ValueError(
                f"The stream has no list column to pack among {raw.column_names}; tokenize it first "
                "(input_ids holding one list of token ids per example)."
            )
        table = raw.select(names).replace_schema_metadata(None)
        lengths = list_lengths(table.column(_length_column(table)))
        tokens = int(lengths.sum())
        counts = TokenCounts(examples=len(lengths), tokens=tokens, kept_tokens=tokens)
        counts.dropped_examples = int((lengths == 0).sum())
        return table, counts

    def _pack(
        self, table: pa.Table | None, carry: dict[str, list[list[Any]]] | None, final: bool, seed: tuple[int, int]
    ) -> tuple[pa.Table, np.ndarray, dict[str, list[list[Any]]] | None, int]:
        """One window's rows (documents carried in first), the order to emit them, the documents carried
        into the next window and the tokens truncated past ``max_length``."""
        if carry is not None:
            carried = _carry_table(carry, table.schema if table is not None else None)
            table = carried if table is None else pa.concat_tables([carried, table])
        lengths = list_lengths(table.column(_length_column(table)))
        truncated = int(np.maximum(lengths - self.max_length, 0).sum()) if self.strategy in (None, "bfd") else 0
        rng = np.random.default_rng([self.seed, *seed])
        if self.strategy is None:
            rows = table
            if truncated:
                rows = pa.table({name: pc.list_slice(table.column(name), 0, self.max_length) for name in table.column_names})
            rows = rows.filter(pa.array(lengths > 0))
            order = np.arange(rows.num_rows)
            return rows, rng.permutation(order) if self.shuffle else order, None, truncated
        rows = pack_table(table, self.max_length, self.strategy)
        row_lengths = list_lengths(rows.column(_length_column(rows)))
        order, carry_out = np.arange(rows.num_rows), None
        if not final and rows.num_rows and row_lengths.min() < self.max_length:
            least_full = int(np.flatnonzero(row_lengths == row_lengths.min())[-1])
            carry_out = _row_as_carry(rows, least_full, self.strategy)
            order = np.delete(order, least_full)
        return rows, rng.permutation(order) if self.shuffle else order, carry_out, truncated


def pack_iterable_dataset(
    source: IterableDataset, max_length: int, strategy: str = "bfd", buffer_size: int = 1000
) -> IterableDataset:
    """``source`` packed on the fly as a ``datasets.IterableDataset`` of rows: what ``pack_dataset`` gives a stream.

    Why a ``datasets.IterableDataset`` rather than the :class:`PackedStream` itself: ``trl.pack_dataset`` returns
    one, and code written for it chains ``.batch``, ``.map``, ``.shuffle``, ``.with_format``, ``.take`` on the
    result. The rows are the stream's (windows of ``buffer_size`` examples, not shuffled), as Python lists in
    the source's format; the columns are the source's list columns and, for ``"bfd"`` / ``"bfd_split"``,
    ``seq_lengths``, typed as the source's when it declares its features. Iterating again packs again, the
    same rows. ``datasets`` gives the one shard to one DataLoader worker (any others stay idle), and its
    ``state_dict`` resumes by skipping the rows already read.
    """
    import datasets

    stream = PackedStream(source, max_length, strategy, buffer_size=buffer_size, shuffle=False)
    features = None
    if source.features is not None:  # a stream read from files may declare none until read
        schema = source.features.arrow_schema
        names = list_columns(schema)
        fields = [schema.field(name) for name in names]
        if strategy != "wrapped":
            fields.append(pa.field("seq_lengths", pa.list_(pa.int32())))
        features = datasets.Features.from_arrow_schema(pa.schema(fields))
        features.update({name: source.features[name] for name in names})
    packed = datasets.IterableDataset.from_generator(_python_rows, features=features, gen_kwargs={"stream": stream})
    format_type = source._formatting.format_type if source._formatting is not None else None  # as TRL reads it
    return packed if format_type is None else packed.with_format(format_type)


def _python_rows(stream: PackedStream) -> Iterator[dict[str, list[int]]]:
    """The rows of ``stream`` as Python lists, what a ``datasets`` generator yields. Without the worker refusal of
    ``PackedStream.__iter__``: ``datasets`` hands this generator, its only shard, to one worker alone."""
    for row in stream._passes():
        yield {name: values.tolist() for name, values in row.items()}


def _start_position(pass_index: int) -> dict[str, Any]:
    return {"pass": pass_index, "window": 0, "source": None, "examples": 0, "carry": None, "rows_done": 0}


def _fresh_view(source: IterableDataset) -> IterableDataset:
    """A shallow copy whose loaded state and position are its own (``copy.copy`` would share its ``__dict__``)."""
    view = object.__new__(type(source))
    view.__dict__.update(source.__dict__)
    return view


def _length_column(table: pa.Table) -> str:
    return "input_ids" if "input_ids" in table.column_names else table.column_names[0]


def _row_as_carry(rows: pa.Table, index: int, strategy: str) -> dict[str, list[list[int]]]:
    """The documents of one packed row, as plain lists (one list per document and column)."""
    names = [name for name in rows.column_names if name != "seq_lengths"]
    values = {name: rows.column(name)[index].values.to_pylist() for name in names}
    if strategy == "wrapped":
        return {name: [items] for name, items in values.items()}
    bounds = np.concatenate(([0], np.cumsum(rows.column("seq_lengths")[index].values.to_numpy())))
    return {name: [items[a:b] for a, b in zip(bounds[:-1], bounds[1:])] for name, items in values.items()}


def _carry_table(carry: dict[str, list[list[Any]]], schema: pa.Schema | None) -> pa.Table:
    if schema is None:
        return pa.table({name: pa.array(documents) for name, documents in carry.items()})
    return pa.table({name: pa.array(carry[name], schema.field(name).type) for name in schema.names})


