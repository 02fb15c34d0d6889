"""SFTDataModule: load, tokenize, mask, truncate or pack, and batch a supervised fine-tuning dataset.

Why one datamodule: every memory technique downstream (packing, padding-free batches, the chunked loss)
relies on the same two columns, ``input_ids`` and unshifted ``labels`` with -100 on untrained tokens.
In memory, tokenization runs through ``datasets.map`` so it is cached and reused across runs; with
``streaming=True`` examples are read, tokenized and packed a window at a time
(:class:`~lit_memtrain.datamodules.streaming.PackedStream`), so a corpus larger than RAM trains with flat
host memory. Either way the training dataloader resumes mid-epoch exactly where a checkpoint left it
(:class:`~lit_memtrain.datamodules.resumable.ResumableDataLoader`), and each data-parallel rank reads its
own share of the training data; the validation rows are dealt over the ranks in even shares whose repeats score
nothing (:mod:`~lit_memtrain.datamodules.validation_shares`; a validation stream is read whole by every rank).

Truncation happens only where tokens are meant to be dropped: without packing and with ``bfd`` each
example keeps its first ``max_length`` tokens; ``bfd_split`` and ``wrapped`` see whole examples and keep
every token. What was kept, truncated and dropped is logged per split (``token_counts``).
"""

# No `from __future__ import annotations`: with every annotation a string, jsonargparse evaluates those of
# `SFTDataModule.__init__` by running this module's TYPE_CHECKING block, which imports datasets and pandas (0.4 s of
# every `lit-memtrain plan`, which reads no data). The names of that block are quoted where they annotate.
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.utils.data import DataLoader

from lit_memtrain.datamodules.batch import IGNORE_INDEX
from lit_memtrain.datamodules.code_fingerprint import data_code_fingerprint
from lit_memtrain.datamodules.collate import PaddedCollator
from lit_memtrain.datamodules.embedded import EMBEDDED
from lit_memtrain.datamodules.packing_plan import STRATEGIES
from lit_memtrain.datamodules.padding_free import PaddingFreeCollator
from lit_memtrain.datamodules.resumable import ResumableDataLoader
from lit_memtrain.datamodules.resumable_datamodule import ResumableDataModule
from lit_memtrain.datamodules.sources import RawData, RowLocator, load_raw_dataset, raise_for_invalid_json
from lit_memtrain.datamodules.splits import check_validation_args, hold_out, load_splits
from lit_memtrain.datamodules.tokenize import (
    DatasetFormat,
    TokenCounts,
    detect_format,
    tokenize_example,
    tokenize_located,
    truncation_warning,
)
from lit_memtrain.datamodules.tokenizer import load_tokenizer
from lit_memtrain.datamodules.validation_shares import StreamShares

if TYPE_CHECKING:  # pyarrow and datasets are imported where data is read: the module imports without them
    from datasets import Dataset

    from lit_memtrain.datamodules.streaming import PackedStream, TokenizedWindow

__all__ = ["SFTDataModule", "load_raw_dataset"]



@dataclass
class WindowTokenizer:
    """Tokenizes a window of a raw stream into Arrow list columns, dropping examples with nothing to train."""

    tokenizer: Any
    dataset_format: str
    max_length: int | None
    completion_only_loss: bool
    assistant_only_loss: bool
    locator: RowLocator

    def __call__(self, rows: dict[str, list], first_index: int) -> "TokenizedWindow":
        import pyarrow as pa

        from lit_memtrain.datamodules.streaming import TokenizedWindow

        columns = list(rows)
        input_ids, labels, counts = [], [], TokenCounts()
        for offset in range(len(rows[columns[0]]) if columns else 0):
            out = tokenize_located(
                {name: rows[name][offset] for name in columns},
                first_index + offset,
                self.locator,
                tokenize_example,
                tokenizer=self.tokenizer,
                dataset_format=self.dataset_format,
                max_length=self.max_length,
                completion_only_loss=self.completion_only_loss,
                assistant_only_loss=self.assistant_only_loss,
            )
            counts.examples += 1
            counts.tokens += out["num_tokens"]
            if out["num_trainable"] == 0:
                counts.dropped_examples += 1
                counts.dropped_tokens += out["num_tokens"]
                continue
            counts.kept_tokens += len(out["input_ids"])
            counts.truncated_tokens += out["num_tokens"] - len(out["input_ids"])
            input_ids.append(out["input_ids"])
            labels.append(out["labels"])
        table = pa.table(
            {"input_ids": pa.array(input_ids, pa.list_(pa.int32())), "labels": pa.array(labels, pa.list_(pa.int32()))}
        )
        return TokenizedWindow(table, counts)


class SFTDataModule(ResumableDataModule):
    """Tokenized, masked, truncated or packed SFT data for a causal LM.

    Args:
        tokenizer: hub id or local path of a tokenizer, or ``"lit-memtrain/embedded"``.
        dataset: hub dataset name, local file or directory, an in-memory ``datasets.Dataset`` (or
            ``IterableDataset`` with ``streaming``), or ``"lit-memtrain/embedded"``.
        dataset_config: the hub dataset's configuration name.
        data_files: passed to ``datasets.load_dataset`` for hub or directory datasets.
        split: split to train on.
        dataset_format: ``auto`` (from the columns), ``text``, ``prompt_completion`` or ``conversational``.
        max_length: tokens per example (truncation) or per packed row.
        completion_only_loss: prompt-completion data trains only on the completion.
        assistant_only_loss: conversations (``messages``, or a prompt and completion given as chat messages) train
            only on assistant turns.
        val_size: fraction (< 1) or number (>= 1) of training examples held out for validation (with
            ``streaming``: a number, the first examples of the stream).
        val_split: name of an existing split to validate on instead.
        batch_size: examples (or packed rows) per training batch; ``val_batch_size`` defaults to it.
        pad_to_multiple_of: round the padded length up to a multiple of this.
        packing: pack examples into rows of at most ``max_length`` tokens (see
            :func:`~lit_memtrain.datamodules.packing.pack_dataset`). Packed rows are always collated
            padding-free, so with ``bfd`` / ``bfd_split`` documents never attend to each other.
        packing_strategy: ``bfd`` (keep the first ``max_length`` tokens of each example, drop the
            overflow), ``bfd_split`` (split long examples into ``max_length`` chunks, lose nothing) or
            ``wrapped`` (fixed blocks that cut examples anywhere and lose nothing; a block is one
            document, so the examples inside it do attend to each other, as in pre-training).
        padding_free: flatten each batch into one row with ``position_ids`` restarting per document
            (defaults to ``packing``).
        streaming: read, tokenize and pack the data on the fly, ``buffer_size`` examples at a time
            (host memory stays flat); the training stream repeats, so set ``Trainer(max_steps=...)``.
        buffer_size: examples per streaming window (packing plans over one window at a time).
        num_workers: DataLoader workers (in-memory data only: a stream is read by the training process).
        num_proc: processes for tokenization with ``datasets.map``.
        seed: seed of the shuffle (in-memory: the order of each epoch; streaming: rows within a window).

    Example:
        >>> dm = SFTDataModule(tokenizer="lit-memtrain/embedded", dataset="lit-memtrain/embedded", max_length=64)
        >>> trainer.fit(CausalLMModule(preset="tiny-qwen3"), datamodule=dm)  # doctest: +SKIP
    """

    def __init__(
        self,
        tokenizer: str = EMBEDDED,
        dataset: str | Any = EMBEDDED,
        dataset_config: str | None = None,
        data_files: str | list[str] | dict[str, Any] | None = None,
        split: str = "train",
        dataset_format: DatasetFormat = "auto",
        max_length: int = 1024,
        completion_only_loss: bool = True,
        assistant_only_loss: bool = True,
        val_size: float = 0.0,
        val_split: str | None = None,
        batch_size: int = 8,
        val_batch_size: int | None = None,
        pad_to_multiple_of: int | None = None,
        packing: bool = False,
        packing_strategy: Literal["bfd", "bfd_split", "wrapped"] = "bfd",
        padding_free: bool | None = None,
        streaming: bool = False,
        buffer_size: int = 1000,
        num_workers: int = 0,
        num_proc: int | None = None,
        seed: int = 42,
    ) -> None:
        super().__init__()
        if max_length < 1:
            raise ValueError(f"max_length must be at least 1 token, got {max_length}.")
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}.")
        check_validation_args(val_size, val_split)
        if packing and padding_free is False:
            raise ValueError(
                "packing=True needs padding-free batches (position ids restarting per document keep packed "
                "documents apart); drop padding_free=False."
            )
        if packing_strategy not in STRATEGIES:
            raise ValueError(f"packing_strategy must be one of {STRATEGIES}, got {packing_strategy!r}.")
        if buffer_size < 1:
            raise ValueError(f"buffer_size must be at least 1 example, got {buffer_size}.")
        if streaming and num_workers:
            raise ValueError(
                "streaming=True reads the stream in order in the training process (that is what makes it "
                "resumable): set num_workers=0."
            )
        if streaming and 0 < val_size < 1:
            raise ValueError(
                f"val_size={val_size} is a fraction, but a stream has no known length: give a number of "
                "examples (the first ones of the stream are held out) or a val_split."
            )
        self.save_hyperparameters(ignore=["dataset"] if not isinstance(dataset, str) else None)
        self.tokenizer_name = tokenizer
        self.dataset = dataset
        self.dataset_config = dataset_config
        self.data_files = data_files
        self.split = split
        self.dataset_format = dataset_format
        self.max_length = max_length
        self.completion_only_loss = completion_only_loss
        self.assistant_only_loss = assistant_only_loss
        self.val_size = val_size
        self.val_split = val_split
        self.batch_size = batch_size
        self.val_batch_size = val_batch_size or batch_size
        self.pad_to_multiple_of = pad_to_multiple_of
        self.packing = packing
        self.packing_strategy = packing_strategy
        self.padding_free = packing if padding_free is None else padding_free
        self.streaming = streaming
        self.buffer_size = buffer_size
        self.num_workers = num_workers
        self.num_proc = num_proc
        self.seed = seed
        self.tokenizer = load_tokenizer(tokenizer)
        self.train_dataset: Dataset | PackedStream | None = None
        self.val_dataset: Dataset | PackedStream | None = None
        self.token_counts: dict[str, TokenCounts] = {}

    @property
    def num_dropped(self) -> int:
        """Training examples dropped for having no trainable token (in-memory data)."""
        return self.token_counts["train"].dropped_examples if "train" in self.token_counts else 0

    @property
    def num_truncated_tokens(self) -> int:
        """Training tokens cut past ``max_length`` (without packing, or by ``bfd``)."""
        return self.token_counts["train"].truncated_tokens if "train" in self.token_counts else 0

    @property
    def _truncate_at(self) -> int | None:
        """Where examples are cut: nowhere for the strategies that keep every token."""
        keeps_everything = self.packing and self.packing_strategy in ("bfd_split", "wrapped")
        return None if keeps_everything else self.max_length

    # ----------------------------------------------------------------------------------------- loading

    def _load(self) -> tuple[RawData, Any, Any]:
        """The raw training split and validation split (or None), in memory or streamed."""
        return load_splits(
            self.dataset, self.dataset_config, self.data_files, self.split, self.val_split, streaming=self.streaming
        )

    def _format_of(self, columns: list[str], raw: RawData, split: str, first: dict[str, Any] | None) -> str:
        try:
            dataset_format = detect_format(columns, self.dataset_format)
        except ValueError as error:
            raise ValueError(f"The {split} split{raw.describe(split)}: {error}") from None
        if dataset_format in ("conversational", "prompt_completion") and not self.tokenizer.chat_template:
            if dataset_format == "conversational" or isinstance((first or {}).get("prompt"), list):
                raise ValueError(
                    f"The {split} data is conversational but tokenizer {self.tokenizer_name!r} has no chat template. "
                    "Use a tokenizer with a chat_template (for example an instruct model's) or set one on it."
                )
        return dataset_format

    def _tokenize_kwargs(self, dataset_format: str, max_length: int | None) -> dict[str, Any]:
        return {
            "tokenizer": self.tokenizer,
            "dataset_format": dataset_format,
            "max_length": max_length,
            "completion_only_loss": self.completion_only_loss,
            "assistant_only_loss": self.assistant_only_loss,
        }

    def _tokenize(self, data: "Dataset", raw: RawData, split: str, name: str, max_length: int | None) -> "Dataset":
        """Tokenize an in-memory split, drop examples with nothing to train, count and log the tokens."""
        from lit_memtrain.datamodules.arrow_lists import list_lengths

        columns = list(data.column_names)
        dataset_format = self._format_of(columns, raw, split, data[0] if len(data) else None)
        tokenized = data.map(
            tokenize_located,
            with_indices=True,
            fn_kwargs={
                "locator": raw.locator(split), "tokenize": tokenize_example,
                "data_code": data_code_fingerprint(),
                **self._tokenize_kwargs(dataset_format, max_length),
            },
            remove_columns=columns,
            num_proc=self.num_proc,
            desc=f"Tokenizing {name} ({dataset_format})",
        )
        table = tokenized.with_format("arrow")[:]
        num_tokens = table.column("num_tokens").to_numpy()
        kept_lengths = list_lengths(table.column("input_ids"))
        keep = table.column("num_trainable").to_numpy() > 0
        counts = TokenCounts(
            examples=len(keep),
            tokens=int(num_tokens.sum()),
            kept_tokens=int(kept_lengths[keep].sum()),
            truncated_tokens=int((num_tokens - kept_lengths)[keep].sum()),
            dropped_examples=int((~keep).sum()),
            dropped_tokens=int(num_tokens[~keep].sum()),
        )
        self.token_counts[name] = counts
        if counts.dropped_examples:
            rank_zero_warn(
                f"Dropped {counts.dropped_examples} of {counts.examples} {name} examples with no trainable token "
                f"(after masking and truncation to max_length={self.max_length})."
            )
        if not keep.any():
            raise ValueError(
                f"The {name} dataset{raw.describe(split)} is empty after filtering: all {counts.examples} examples "
                f"have no trainable token after masking and truncation to max_length={self.max_length}. Raise "
                "max_length, or check the loss masks (completion_only_loss / assistant_only_loss) against your columns."
            )
        rank_zero_info(f"{name}: {counts.describe(self.max_length)}.")
        # An example whose trainable tokens all lie past max_length is dropped whole: its tokens are lost to the cut.
        cut_whole = int(num_tokens[~keep & (num_tokens > kept_lengths)].sum())
        warning = truncation_warning(
            counts.truncated_tokens + cut_whole, counts.tokens, name, f"max_length={self.max_length}",
            "a larger --data.max_length (lit-memtrain lengths recommends one), or --data.packing=true "
            "--data.packing_strategy=bfd_split (long examples split into chunks that all train)",
        )  # fmt: skip
        if warning:
            rank_zero_warn(warning)
        return tokenized.filter(lambda n: n > 0, input_columns="num_trainable", num_proc=self.num_proc)

    def _prepare(self) -> "tuple[Dataset, Dataset | None]":
        raw, data, val_data = self._load()
        if len(data) == 0:
            raise ValueError(f"The training split {self.split!r}{raw.describe(self.split)} is empty.")
        train = self._tokenize(data, raw, self.split, "train", self._truncate_at)
        val = None
        if val_data is not None:
            val = self._tokenize(val_data, raw, self.val_split, "validation", self._truncate_at)
        elif self.val_size:
            train, val = hold_out(train, self.val_size, self.seed, "examples")
        if self.packing:
            train = self._pack(train)
            val = self._pack(val) if val is not None else None
        return train, val

    def _pack(self, dataset: "Dataset") -> "Dataset":
        """Pack the tokenized split; the result is cached beside the tokenization cache when there is one."""
        import datasets

        from lit_memtrain.datamodules.packing import pack_dataset

        dataset = dataset.select_columns(["input_ids", "labels"])
        cache_files = dataset.cache_files
        if not cache_files:
            return pack_dataset(dataset, self.max_length, self.packing_strategy)
        key = f"packed-{dataset._fingerprint}-{self.max_length}-{self.packing_strategy}"
        path = Path(cache_files[0]["filename"]).parent / key
        if path.exists():
            return datasets.load_from_disk(str(path))
        packed = pack_dataset(dataset, self.max_length, self.packing_strategy)
        packed.save_to_disk(str(path))
        return packed

    # --------------------------------------------------------------------------------------- streaming

    def _stream(
        self, data: Any, raw: RawData, split: str, name: str, train: bool, whole: bool = False, share: bool = True,
        held_out: int = 0,
    ) -> "PackedStream":
        """A stream of this rank's share of ``data`` (``share=False``: all of it), tokenized and packed (or
        truncated) a window at a time; ``whole`` yields the tokenized examples uncut and unpacked (for the length
        profiler). ``held_out``: ``data`` starts after that many rows of ``split`` (``data.skip``), held out for
        validation."""
        from datasets.distributed import split_dataset_by_node

        from lit_memtrain.datamodules.streaming import PackedStream

        try:
            first = next(iter(data.take(1)), None)
        except Exception as error:  # noqa: BLE001 - re-raised, with the bad JSON line when there is one
            raise_for_invalid_json(raw.files.get(split, ()), error)
            raise
        if first is None:
            raise ValueError(f"The {name} stream{raw.describe(split)} is empty.")
        dataset_format = self._format_of(list(first), raw, split, first)
        replicas, rank = self.data_parallel()
        locator = raw.locator(split)
        locator = RowLocator(locator.files, locator.split, offset=held_out)
        if share and replicas > 1:
            # Whole shards when they divide evenly, else every replicas-th row. Not shards after a hold-out: datasets
            # then splits the skipped count over the shards (each rank skips its part of its own shards), so some
            # validation rows would train and as many training rows would be skipped.
            by_shards = not held_out and data.num_shards % replicas == 0 and data.num_shards > 1
            if by_shards:
                locator = RowLocator((), f"the shards of rank {rank} of the {split} split")
            else:
                locator = RowLocator(locator.files, locator.split, step=replicas, offset=held_out + rank)
            data = split_dataset_by_node(
                data, rank=rank, world_size=replicas, strategy="shards" if by_shards else "examples"
            )
        truncate_at = None if whole else self._truncate_at
        tokenize = WindowTokenizer(**self._tokenize_kwargs(dataset_format, truncate_at), locator=locator)

        def log(counts: TokenCounts) -> None:
            self.token_counts[name] = counts
            whose = f"rank {rank}" if share and replicas > 1 else "all ranks"
            rank_zero_info(f"{name} stream ({whose}), one pass: {counts.describe(self.max_length)}.")

        return PackedStream(
            data,
            2**62 if whole else self.max_length,
            self.packing_strategy if self.packing and not whole else None,
            buffer_size=self.buffer_size,
            tokenize=tokenize,
            shuffle=train,
            seed=self.seed,
            repeat=train,
            on_pass_end=log,
            files=raw.files.get(split, ()),
        )

    def _prepare_stream(self) -> "tuple[PackedStream, PackedStream | None]":
        raw, data, val_data = self._load()
        held_out = int(self.val_size)
        if held_out:
            val_data, data = data.take(held_out), data.skip(held_out)
        train = self._stream(data, raw, self.split, "train", train=True, held_out=held_out)
        val = None
        if val_data is not None:
            # Read whole by every rank, and dealt when loaded: shares of a stream read apart would hold numbers of
            # rows no rank knows beforehand, and a rank with a batch fewer would leave the others waiting (FSDP2).
            val = self._stream(val_data, raw, self.val_split or self.split, "validation", train=False, share=False)
        return train, val

    # ------------------------------------------------------------------------------------------- hooks

    def prepare_data(self) -> None:
        # Runs on one process per node before setup: it fills the datasets cache that the other ranks read.
        # This process keeps the result, so its own setup does not redo the work.
        if not self.streaming and isinstance(self.dataset, str) and self.train_dataset is None:
            self.train_dataset, self.val_dataset = self._prepare()

    def setup(self, stage: str) -> None:
        if self.streaming:
            trainer = self.trainer
            if stage == "fit" and trainer is not None and trainer.max_steps < 0:
                raise ValueError(
                    "streaming=True trains on a stream that repeats without end (every rank stays in step): "
                    "set Trainer(max_steps=...) to say how long to train."
                )
            if self.train_dataset is None:
                self.train_dataset, self.val_dataset = self._prepare_stream()
        elif self.train_dataset is None:
            self.train_dataset, self.val_dataset = self._prepare()

    def token_lengths(self, sample: int | None = None) -> np.ndarray:
        """Untruncated token lengths of the training examples that have something to train (for the length
        profiler); with ``streaming``, of the first ``sample`` examples of the stream (10,000 by default)."""
        raw, data, _ = self._load()
        if self.streaming:
            stream = self._stream(data.take(sample or 10_000), raw, self.split, "train", train=False, whole=True)
            return np.array([len(row["input_ids"]) for row in stream], dtype=np.int64)
        from lit_memtrain.datamodules.arrow_lists import list_lengths

        tokenized = self._tokenize(data, raw, self.split, "train", None)
        lengths = list_lengths(tokenized.with_format("arrow")[:].column("input_ids"))
        return lengths if sample is None else lengths[:sample]

    def collator(self) -> PaddedCollator | PaddingFreeCollator:
        if self.padding_free:
            return PaddingFreeCollator(self.tokenizer.pad_token_id, self.pad_to_multiple_of)
        return PaddedCollator(self.tokenizer.pad_token_id, self.pad_to_multiple_of)

    def _columns(self, dataset: "Dataset") -> "Dataset":
        columns = ["input_ids", "labels", "seq_lengths"] if "seq_lengths" in dataset.column_names else ["input_ids", "labels"]
        return dataset.select_columns(columns)

    def train_dataloader(self) -> ResumableDataLoader:
        if self.streaming:  # the stream shuffles within its windows and is read by this process
            return self.resumable_train_loader(self.train_dataset, self.batch_size, self.collator())
        return self.resumable_train_loader(
            self._columns(self.train_dataset), self.batch_size, self.collator(), self.seed, self.num_workers
        )

    def val_dataloader(self) -> DataLoader | list:
        if self.val_dataset is None:
            return []
        if self.streaming:
            shares = StreamShares(self.val_dataset, _unscored, *self.data_parallel())
            return DataLoader(shares, batch_size=self.val_batch_size, collate_fn=self.collator())
        return self.validation_loader(
            self._columns(self.val_dataset), self.val_batch_size, self.collator(), _unscored, self.num_workers
        )


def _unscored(row: dict[str, Any]) -> dict[str, Any]:
    """A validation row with nothing to score: the repeat that evens the ranks out counts no token."""
    return {**row, "labels": [IGNORE_INDEX] * len(row["labels"])}
