"""SFTDataModule: load, tokenize, mask, truncate and batch a supervised fine-tuning dataset.

Why one datamodule: every memory technique downstream (packing, padding-free batches, the chunked loss)
relies on the same two columns, ``input_ids`` and unshifted ``labels`` with -100 on untrained tokens.
Tokenization runs through ``datasets.map`` so it is cached and reused across runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.pytorch import LightningDataModule
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.utils.data import DataLoader

from lit_memtrain.datamodules.collate import PaddedCollator
from lit_memtrain.datamodules.padding_free import PaddingFreeCollator
from lit_memtrain.datamodules.embedded import EMBEDDED, embedded_dataset_path
from lit_memtrain.datamodules.tokenize import DatasetFormat, detect_format, tokenize_example
from lit_memtrain.tokenizer import load_tokenizer

if TYPE_CHECKING:
    from datasets import Dataset, DatasetDict

_FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".txt": "text"}


def load_raw_dataset(
    dataset: str | Dataset | DatasetDict,
    dataset_config: str | None = None,
    data_files: str | list[str] | dict[str, Any] | None = None,
) -> Dataset | DatasetDict:
    """Load a hub dataset name, a local file (jsonl, json, parquet, csv, txt), a directory, or pass a Dataset through."""
    import datasets

    if isinstance(dataset, (datasets.Dataset, datasets.DatasetDict)):
        return dataset
    if dataset == EMBEDDED:
        return datasets.load_dataset("json", data_files=embedded_dataset_path())
    path = Path(dataset)
    if path.is_file():
        builder = _FILE_BUILDERS.get(path.suffix.lower())
        if builder is None:
            raise ValueError(
                f"Cannot load {dataset!r}: unknown file type {path.suffix!r}. Supported: {', '.join(_FILE_BUILDERS)}."
            )
        return datasets.load_dataset(builder, data_files=str(path))
    if path.is_dir() and ((path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists()):
        return datasets.load_from_disk(str(path))
    return datasets.load_dataset(dataset, dataset_config, data_files=data_files)


class SFTDataModule(LightningDataModule):
    """Tokenized, masked and truncated SFT data for a causal LM.

    Args:
        tokenizer: hub id or local path of a tokenizer, or ``"lit-memtrain/embedded"``.
        dataset: hub dataset name, local file or directory, an in-memory ``datasets.Dataset``, or
            ``"lit-memtrain/embedded"``.
        dataset_config: the hub dataset's configuration name.
        data_files: passed to ``datasets.load_dataset`` for hub or directory datasets.
        split: split to train on.
        dataset_format: ``auto`` (from the columns), ``text``, ``prompt_completion`` or ``conversational``.
        max_length: keep the first ``max_length`` tokens of each example.
        completion_only_loss: prompt-completion data trains only on the completion.
        assistant_only_loss: conversations train only on assistant turns.
        val_size: fraction (< 1) or number (>= 1) of training examples held out for validation.
        val_split: name of an existing split to validate on instead.
        batch_size: examples per training batch; ``val_batch_size`` defaults to it.
        pad_to_multiple_of: round the padded length up to a multiple of this.
        packing: pack whole examples into rows of at most ``max_length`` tokens (after tokenization and
            truncation; see :func:`~lit_memtrain.datamodules.packing.pack_dataset`). Packed rows are
            always collated padding-free, so with ``bfd`` / ``bfd_split`` documents never attend to each other.
        packing_strategy: ``bfd`` (drop overflow), ``bfd_split`` (split long examples, lose nothing) or
            ``wrapped`` (fixed blocks that cut examples anywhere; a block is one document, so the examples
            inside it do attend to each other, as in pre-training).
        padding_free: flatten each batch into one row with ``position_ids`` restarting per document
            (defaults to ``packing``).

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
        num_workers: int = 0,
        num_proc: int | None = None,
        seed: int = 42,
    ) -> None:
        super().__init__()
        if max_length < 1:
            raise ValueError(f"max_length must be at least 1 token, got {max_length}.")
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}.")
        if val_size < 0:
            raise ValueError(f"val_size must be >= 0 (a fraction below 1 or a count), got {val_size}.")
        if val_size and val_split:
            raise ValueError("Give either val_size (hold out part of the training split) or val_split, not both.")
        if packing and padding_free is False:
            raise ValueError(
                "packing=True needs padding-free batches (position ids restarting per document keep packed "
                "documents apart); drop padding_free=False."
            )
        from lit_memtrain.datamodules.packing import STRATEGIES

        if packing_strategy not in STRATEGIES:
            raise ValueError(f"packing_strategy must be one of {STRATEGIES}, got {packing_strategy!r}.")
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
        self.num_workers = num_workers
        self.num_proc = num_proc
        self.seed = seed
        self.tokenizer = load_tokenizer(tokenizer)
        self.train_dataset: Dataset | None = None
        self.val_dataset: Dataset | None = None
        self.num_dropped = 0

    def _tokenize(self, raw: Dataset, name: str) -> tuple[Dataset, int]:
        columns = list(raw.column_names)
        dataset_format = detect_format(columns, self.dataset_format)
        if dataset_format in ("conversational", "prompt_completion") and not self.tokenizer.chat_template:
            first = raw[0] if len(raw) else {}
            if dataset_format == "conversational" or isinstance(first.get("prompt"), list):
                raise ValueError(
                    f"The {name} data is conversational but tokenizer {self.tokenizer_name!r} has no chat template. "
                    "Use a tokenizer with a chat_template (for example an instruct model's) or set one on it."
                )
        fn_kwargs = {
            "tokenizer": self.tokenizer,
            "dataset_format": dataset_format,
            "max_length": self.max_length,
            "completion_only_loss": self.completion_only_loss,
            "assistant_only_loss": self.assistant_only_loss,
        }
        tokenized = raw.map(
            tokenize_example,
            fn_kwargs=fn_kwargs,
            remove_columns=columns,
            num_proc=self.num_proc,
            desc=f"Tokenizing {name} ({dataset_format})",
        )
        kept = tokenized.filter(lambda n: n > 0, input_columns="num_trainable", num_proc=self.num_proc)
        dropped = len(tokenized) - len(kept)
        if dropped:
            rank_zero_warn(
                f"Dropped {dropped} of {len(tokenized)} {name} examples with no trainable token "
                f"(after masking and truncation to max_length={self.max_length})."
            )
        if len(kept) == 0:
            raise ValueError(
                f"The {name} dataset is empty after filtering: all {len(tokenized)} examples have no trainable token "
                f"after masking and truncation to max_length={self.max_length}. Raise max_length, or check the "
                "loss masks (completion_only_loss / assistant_only_loss) against your columns."
            )
        rank_zero_info(f"{name}: {len(kept)} examples ({dropped} dropped).")
        return kept, dropped

    def _prepare(self) -> tuple[Dataset, Dataset | None, int]:
        import datasets

        raw = load_raw_dataset(self.dataset, self.dataset_config, self.data_files)
        val_raw = None
        if isinstance(raw, datasets.DatasetDict):
            if self.split not in raw:
                raise ValueError(f"Split {self.split!r} not found; the dataset has splits {list(raw)}.")
            if self.val_split is not None:
                if self.val_split not in raw:
                    raise ValueError(f"val_split {self.val_split!r} not found; the dataset has splits {list(raw)}.")
                val_raw = raw[self.val_split]
            raw = raw[self.split]
        elif self.val_split is not None:
            raise ValueError(f"val_split={self.val_split!r} was given but the dataset has a single split.")
        if len(raw) == 0:
            raise ValueError(f"The training split {self.split!r} is empty.")
        train, dropped = self._tokenize(raw, "train")
        val = None
        if val_raw is not None:
            val, _ = self._tokenize(val_raw, "validation")
        elif self.val_size:
            size = self.val_size if self.val_size < 1 else int(self.val_size)
            if isinstance(size, int) and size >= len(train):
                raise ValueError(f"val_size={self.val_size} leaves no training data out of {len(train)} examples.")
            parts = train.train_test_split(test_size=size, seed=self.seed)
            train, val = parts["train"], parts["test"]
        if self.packing:
            train = self._pack(train)
            val = self._pack(val) if val is not None else None
        return train, val, dropped

    def _pack(self, dataset: Dataset) -> Dataset:
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

    def prepare_data(self) -> None:
        # Runs on one process per node before setup: it fills the datasets cache that the other ranks read.
        # This process keeps the result, so its own setup does not redo the work.
        if isinstance(self.dataset, str) and self.train_dataset is None:
            self.train_dataset, self.val_dataset, self.num_dropped = self._prepare()

    def setup(self, stage: str) -> None:
        if self.train_dataset is None:
            self.train_dataset, self.val_dataset, self.num_dropped = self._prepare()

    def collator(self) -> PaddedCollator | PaddingFreeCollator:
        if self.padding_free:
            return PaddingFreeCollator(self.tokenizer.pad_token_id, self.pad_to_multiple_of)
        return PaddedCollator(self.tokenizer.pad_token_id, self.pad_to_multiple_of)

    def _loader(self, dataset: Dataset, batch_size: int, shuffle: bool) -> DataLoader:
        columns = ["input_ids", "labels", "seq_lengths"] if "seq_lengths" in dataset.column_names else ["input_ids", "labels"]
        return DataLoader(
            dataset.select_columns(columns),
            batch_size=batch_size,
            shuffle=shuffle,
            collate_fn=self.collator(),
            num_workers=self.num_workers,
            generator=torch.Generator().manual_seed(self.seed) if shuffle else None,
            persistent_workers=self.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_dataset, self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader | list:
        if self.val_dataset is None:
            return []
        return self._loader(self.val_dataset, self.val_batch_size, shuffle=False)
