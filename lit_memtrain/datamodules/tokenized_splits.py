"""TokenizedSplitsDataModule: a training split and an optional validation split, tokenized once, in memory.

Why a base class: preference pairs (DPO, reward models) and RL prompts are read, tokenized, held out and loaded
the same way; only how a split is read and tokenized and how a batch is collated differ. The shared steps live
here once: load the splits, refuse an empty training split, tokenize each, hold out ``val_size`` when no
``val_split`` is named, and serve a resumable shuffled training loader and an ordered validation loader (each
data-parallel rank its share; a repeat that evens the shares out is marked, and the modules leave it out of their
metrics: :data:`~lit_memtrain.datamodules.batch.SCORED`).
(:class:`~lit_memtrain.datamodules.sft.SFTDataModule` packs and streams, and keeps its own steps.)
"""

# No `from __future__ import annotations`: with every annotation a string, jsonargparse evaluates those of
# `TokenizedSplitsDataModule.__init__` by running this module's TYPE_CHECKING block, which imports datasets and
# pandas (0.4 s of every `lit-memtrain plan`, which reads no data). `Dataset` is quoted where it annotates.
from abc import abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

from torch.utils.data import DataLoader

from lit_memtrain.datamodules.batch import mark_unscored
from lit_memtrain.datamodules.resumable import ResumableDataLoader
from lit_memtrain.datamodules.resumable_datamodule import ResumableDataModule
from lit_memtrain.datamodules.sources import RawData
from lit_memtrain.datamodules.splits import hold_out

if TYPE_CHECKING:
    from datasets import Dataset

__all__ = ["TokenizedSplitsDataModule"]


class TokenizedSplitsDataModule(ResumableDataModule):
    """Subclasses set ``split``, ``val_split``, ``val_size``, ``seed``, ``batch_size``, ``val_batch_size``,
    ``num_workers`` and ``datasets = {}`` in ``__init__``, name what one row is (``unit``, for the hold-out's
    messages), and implement :meth:`_load`, :meth:`_tokenize` and :meth:`collator`.

    Example:
        >>> class Questions(TokenizedSplitsDataModule):
        ...     unit = "questions"
        ...     def _load(self): return load_splits("questions.jsonl", None, None, "train", None)  # doctest: +SKIP
        ...     def _tokenize(self, data, raw, split, name): return data.map(...)  # doctest: +SKIP
        ...     def collator(self): return my_collate  # doctest: +SKIP
    """

    unit: ClassVar[str] = "rows"
    datasets: "dict[str, Dataset]"

    @abstractmethod
    def _load(self) -> tuple[RawData, Any, Any]:
        """The raw data, its training split and its validation split (or None)."""

    @abstractmethod
    def _tokenize(self, data: "Dataset", raw: RawData, split: str, name: str) -> "Dataset":
        """The split ``split`` of ``raw`` tokenized (``name``: ``"train"`` or ``"validation"``, for the log)."""

    @abstractmethod
    def collator(self) -> Any:
        """What makes a batch of tokenized rows."""

    @property
    def train_dataset(self) -> "Dataset | None":
        return self.datasets.get("train")

    @property
    def val_dataset(self) -> "Dataset | None":
        return self.datasets.get("validation")

    def _prepare(self) -> None:
        raw, data, val_data = self._load()
        if len(data) == 0:
            raise ValueError(f"The training split {self.split!r}{raw.describe(self.split)} is empty.")
        train = self._tokenize(data, raw, self.split, "train")
        if val_data is not None:
            self.datasets["validation"] = self._tokenize(val_data, raw, self.val_split, "validation")
        elif self.val_size:
            train, self.datasets["validation"] = hold_out(train, self.val_size, self.seed, self.unit)
        self.datasets["train"] = train

    def prepare_data(self) -> None:
        if isinstance(self.dataset, str) and not self.datasets:
            self._prepare()

    def setup(self, stage: str) -> None:
        if not self.datasets:
            self._prepare()

    def train_dataloader(self) -> ResumableDataLoader:
        return self.resumable_train_loader(
            self.datasets["train"], self.batch_size, self.collator(), self.seed, self.num_workers
        )

    def val_dataloader(self) -> DataLoader | list:
        if "validation" not in self.datasets:
            return []
        return self.validation_loader(
            self.datasets["validation"], self.val_batch_size, self.collator(), mark_unscored, self.num_workers
        )
