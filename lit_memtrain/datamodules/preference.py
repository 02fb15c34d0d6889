"""PreferenceDataModule: load, tokenize, truncate and batch a preference (DPO) dataset.

Why its own datamodule: a preference example is a pair of sequences sharing a prompt, and DPO compares
them, so pairs are never packed apart or split; what SFT's memory techniques give it is truncation
(``max_prompt_length`` / ``max_length``) and padding-free batches (every pair's chosen and rejected sequence
flattened into one row, documents kept apart: :mod:`~lit_memtrain.datamodules.preference_collate`).

``max_length`` and ``truncation_mode`` mean what they mean in TRL's ``DPOConfig`` (the whole sequence keeps its
start; a pair whose prompt alone fills ``max_length`` is dropped, counted and logged once per split), so a TRL
config's values carry over. ``max_prompt_length``, which TRL no longer has, cuts long prompts first, keeping the
end ``prompt_truncation`` names. ``prompt_truncation`` has no default because ``truncation_mode`` used to choose
that end here (``keep_end`` by default): a config written then fails with the fix rather than silently keeping
the other end of its prompts.

A reward model (TRL's ``RewardTrainer``) reads each sequence's score at its last token, so its pairs must not be
cut: ``long_pairs="drop"`` drops every pair with a sequence longer than ``max_length``, as ``RewardTrainer`` does,
instead of truncating. A ``margin`` column (TRL's, for the reward loss) is kept and batched.

The reference model's log-probabilities, when precomputed, are stored with the dataset as the
``ref_chosen_logps`` / ``ref_rejected_logps`` columns TRL uses (a dataset that already has them is used as
is): the module computes them in one pass before training (:meth:`reference_dataloader`) and hands them back
(:meth:`set_reference_logps`); the data code itself knows no model.
"""

# No `from __future__ import annotations`: with every annotation a string, jsonargparse evaluates those of
# `PreferenceDataModule.__init__` by running this module's TYPE_CHECKING block, which imports datasets and
# pandas (0.4 s of every `lit-memtrain plan`, which reads no data). `Dataset` is quoted where it annotates.
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.utils.data import DataLoader

from lit_memtrain.datamodules.code_fingerprint import data_code_fingerprint
from lit_memtrain.datamodules.embedded import EMBEDDED, embedded_preference_path
from lit_memtrain.datamodules.preference_collate import MARGIN_COLUMN, REFERENCE_COLUMNS, PreferenceCollator
from lit_memtrain.datamodules.preference_tokenize import (
    PromptTruncation,
    detect_preference_format,
    tokenize_preference,
)
from lit_memtrain.datamodules.sources import RawData
from lit_memtrain.datamodules.splits import check_validation_args, load_splits
from lit_memtrain.datamodules.tokenize import TokenCounts, tokenize_located, truncation_warning
from lit_memtrain.datamodules.tokenized_splits import TokenizedSplitsDataModule
from lit_memtrain.datamodules.tokenizer import load_tokenizer

if TYPE_CHECKING:
    from datasets import Dataset

__all__ = ["PreferenceDataModule"]

_TOKENIZED_COLUMNS = ["prompt_ids", "chosen_ids", "rejected_ids"]
_KEPT_COLUMNS = (*REFERENCE_COLUMNS, MARGIN_COLUMN)  # carried from the dataset to the batches as they are
LongPairs = Literal["truncate", "drop"]



class PreferenceDataModule(TokenizedSplitsDataModule):
    """Tokenized, truncated, padded or padding-free preference pairs for DPO and reward models.

    Args:
        tokenizer: hub id or local path of a tokenizer, or ``"lit-memtrain/embedded"``.
        dataset: hub dataset name, local file or directory, an in-memory ``datasets.Dataset``, or
            ``"lit-memtrain/embedded"`` (the quickstart tasks: the exact answer chosen over a wrong one).
        dataset_config, data_files, split: as for :class:`~lit_memtrain.datamodules.sft.SFTDataModule`.
        max_length: tokens per sequence (prompt + chosen, prompt + rejected, as in TRL's ``DPOConfig``): each
            sequence keeps its first ``max_length`` tokens, so completions are cut at their end; a pair whose
            prompt alone has ``max_length`` tokens or more is dropped (counted in the log), as TRL drops it.
            With ``long_pairs="drop"`` no sequence is cut: a pair with a sequence longer than ``max_length`` is
            dropped (TRL's ``RewardConfig.max_length``).
        long_pairs: ``"truncate"`` (TRL's ``DPOTrainer``, above) or ``"drop"`` (TRL's ``RewardTrainer``: a reward
            model reads its score at each sequence's last token, which a cut would remove).
        truncation_mode: TRL's: how a sequence longer than ``max_length`` is cut. Only ``"keep_start"``, TRL's
            default (TRL deprecates ``"keep_end"``, which cuts each sequence's prompt at a different place).
        max_prompt_length: tokens kept of each prompt before ``max_length`` applies (``None``: all), so that a
            long prompt is cut instead of its pair dropped; below ``max_length``. Needs ``prompt_truncation``.
        prompt_truncation: which prompt tokens ``max_prompt_length`` keeps: ``"keep_end"`` (the last ones,
            nearest the answer) or ``"keep_start"``; no default, because ``truncation_mode`` chose this before it
            followed TRL, and a config of that time must not silently keep the other end.
        val_size: fraction (< 1) or number (>= 1) of training pairs held out for validation.
        val_split: name of an existing split to validate on instead.
        batch_size: pairs per training batch (``2 * batch_size`` sequences); ``val_batch_size`` defaults to it.
        padding_free: flatten each batch into one row, position ids restarting per sequence (default); else
            right-pad one row per sequence.
        pad_to_multiple_of: round the row (padding-free) or the padded length up to a multiple of this (TRL's
            option: round shapes for kernels and compilers).
        num_workers: DataLoader workers.
        num_proc: processes for tokenization with ``datasets.map``.
        seed: seed of the training shuffle and of the validation hold-out.

    Example:
        >>> dm = PreferenceDataModule(tokenizer="lit-memtrain/embedded", dataset="lit-memtrain/embedded", max_length=64)
        >>> trainer.fit(DPOModule(preset="tiny-qwen3", beta=0.1), datamodule=dm)  # doctest: +SKIP
    """

    unit = "pairs"

    def __init__(
        self,
        tokenizer: str = EMBEDDED,
        dataset: str | Any = EMBEDDED,
        dataset_config: str | None = None,
        data_files: str | list[str] | dict[str, Any] | None = None,
        split: str = "train",
        max_length: int = 1024,
        max_prompt_length: int | None = None,
        truncation_mode: str = "keep_start",
        prompt_truncation: PromptTruncation | None = None,
        long_pairs: LongPairs = "truncate",
        val_size: float = 0.0,
        val_split: str | None = None,
        batch_size: int = 8,
        val_batch_size: int | None = None,
        padding_free: bool = True,
        pad_to_multiple_of: int | None = None,
        num_workers: int = 0,
        num_proc: int | None = None,
        seed: int = 42,
    ) -> None:
        super().__init__()
        if max_length < 2:
            raise ValueError(f"max_length must leave room for a prompt token and a completion token, got {max_length}.")
        if max_prompt_length is not None and not 1 <= max_prompt_length < max_length:
            raise ValueError(
                f"max_prompt_length must be at least 1 and below max_length={max_length} (room for the completion), "
                f"got {max_prompt_length}."
            )
        if truncation_mode != "keep_start":
            raise ValueError(
                f"truncation_mode={truncation_mode!r} is not supported. truncation_mode is TRL's (DPOConfig): how a "
                "sequence longer than max_length is cut, and only 'keep_start' (TRL's default; TRL deprecates "
                "'keep_end') is supported. It used to pick which prompt tokens max_prompt_length keeps: that is now "
                "prompt_truncation ('keep_end' or 'keep_start')."
            )
        if long_pairs not in ("truncate", "drop"):
            raise ValueError(
                f"long_pairs must be 'truncate' (cut sequences at max_length, TRL's DPOTrainer) or 'drop' (drop pairs "
                f"with a sequence over max_length, TRL's RewardTrainer), got {long_pairs!r}."
            )
        if prompt_truncation not in (None, "keep_start", "keep_end"):
            raise ValueError(f"prompt_truncation must be 'keep_end' or 'keep_start', got {prompt_truncation!r}.")
        if max_prompt_length is not None and prompt_truncation is None:
            raise ValueError(
                f"max_prompt_length={max_prompt_length} cuts long prompts: set prompt_truncation to the tokens it "
                "keeps, 'keep_end' (the last ones, nearest the answer; what truncation_mode='keep_end', its default, "
                "did before truncation_mode followed TRL) or 'keep_start'."
            )
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1 pair, got {batch_size}.")
        check_validation_args(val_size, val_split)
        if pad_to_multiple_of is not None and pad_to_multiple_of < 1:
            raise ValueError(f"pad_to_multiple_of must be a positive integer or None, got {pad_to_multiple_of}.")
        self.save_hyperparameters(ignore=["dataset"] if not isinstance(dataset, str) else None)
        self.tokenizer_name = tokenizer
        self.dataset = dataset
        self.dataset_config = dataset_config
        self.data_files = data_files
        self.split = split
        self.max_length = max_length
        self.max_prompt_length = max_prompt_length
        self.truncation_mode = truncation_mode
        self.prompt_truncation = prompt_truncation
        self.long_pairs = long_pairs
        self.val_size = val_size
        self.val_split = val_split
        self.batch_size = batch_size
        self.val_batch_size = val_batch_size or batch_size
        self.padding_free = padding_free
        self.pad_to_multiple_of = pad_to_multiple_of
        self.num_workers = num_workers
        self.num_proc = num_proc
        self.seed = seed
        self.tokenizer = load_tokenizer(tokenizer)
        self.datasets: dict[str, Dataset] = {}
        self.token_counts: dict[str, TokenCounts] = {}

    # ----------------------------------------------------------------------------------------- loading

    def _load(self) -> tuple[RawData, Any, Any]:
        dataset = embedded_preference_path() if self.dataset == EMBEDDED else self.dataset
        return load_splits(
            dataset, self.dataset_config, self.data_files, self.split, self.val_split, val_split_label="Split"
        )

    def _tokenize(self, data: "Dataset", raw: RawData, split: str, name: str) -> "Dataset":
        """Tokenize and truncate a split, drop the pairs that do not fit ``max_length`` (:attr:`dropped_pairs`);
        count and log."""
        cut_at = self.max_length if self.long_pairs == "truncate" else None
        tokenized = self._tokenize_pairs(data, raw, split, name, cut_at)
        table = tokenized.with_format("arrow")[:]
        fits = self._fits(table)
        counts = self.token_counts[name] = _counts(table, fits)
        if counts.dropped_examples:
            trainer = "DPOTrainer" if self.long_pairs == "truncate" else "RewardTrainer"
            rank_zero_warn(
                f"Dropped {counts.dropped_examples} of {counts.examples} {name} pairs {self.dropped_pairs} (TRL's "
                f"{trainer} drops them too). Set max_prompt_length (with prompt_truncation) to cut long prompts "
                "instead, or raise max_length."
            )
        if not fits.any():
            every = (
                f"the prompts of all {counts.examples} pairs have max_length={self.max_length} tokens or more"
                if self.long_pairs == "truncate"
                else f"all {counts.examples} pairs have a sequence longer than max_length={self.max_length} tokens"
            )
            raise ValueError(
                f"The {name} dataset{raw.describe(split)} is empty after dropping pairs: {every}. Raise max_length, "
                "or set max_prompt_length (with prompt_truncation) to cut the prompts."
            )
        rank_zero_info(f"{name}: {counts.describe(self.max_length)} (pairs; tokens of both sequences).")
        warning = truncation_warning(
            counts.truncated_tokens, counts.tokens, name, f"max_length={self.max_length}",
            "a larger --data.max_length (lit-memtrain lengths profiles the pairs' sequences)",
        )  # fmt: skip
        if warning:
            rank_zero_warn(warning)
        kept_columns = [c for c in _KEPT_COLUMNS if c in tokenized.column_names]
        if counts.dropped_examples:
            tokenized = tokenized.select(np.flatnonzero(fits))
        return tokenized.select_columns(_TOKENIZED_COLUMNS + kept_columns)

    def _tokenize_pairs(
        self, data: "Dataset", raw: RawData, split: str, name: str, max_length: int | None
    ) -> "Dataset":
        """Tokenize a split's pairs (prompts cut to ``max_prompt_length``, sequences to ``max_length``), keeping
        ``num_tokens`` and any reference columns; a pair whose prompt fills ``max_length`` has empty completions."""
        columns = list(data.column_names)
        try:
            detect_preference_format(columns)
        except ValueError as error:
            raise ValueError(f"The {split} split{raw.describe(split)}: {error}") from None
        first = data[0] if len(data) else {}
        if isinstance(first.get("chosen"), list) and not self.tokenizer.chat_template:
            raise ValueError(
                f"The {split} data is conversational but tokenizer {self.tokenizer_name!r} has no chat template. "
                "Use a tokenizer with a chat_template (for example an instruct model's) or set one on it."
            )
        kept_columns = [c for c in _KEPT_COLUMNS if c in columns]
        tokenized = data.map(
            tokenize_located,
            with_indices=True,
            fn_kwargs={
                "locator": raw.locator(split),
                "tokenize": tokenize_preference,
                "data_code": data_code_fingerprint(),
                "tokenizer": self.tokenizer,
                "max_length": max_length,
                "max_prompt_length": self.max_prompt_length,
                "prompt_truncation": self.prompt_truncation,
            },
            remove_columns=[c for c in columns if c not in kept_columns],
            num_proc=self.num_proc,
            desc=f"Tokenizing {name} (preference pairs)",
        )
        return tokenized

    def token_lengths(self, sample: int | None = None) -> np.ndarray:
        """Token lengths of the training pairs' sequences, for the length profiler: prompt + chosen and prompt +
        rejected of each pair, in that order, as training tokenizes them with the prompt cut to
        ``max_prompt_length`` but no ``max_length`` (whose cut the profiler measures); of the first ``sample``
        pairs when given, every pair included. ``token_counts["train"]`` then counts the prompt tokens
        ``max_prompt_length`` cut (``truncated_tokens``) and the pairs that training drops at ``max_length``
        (``dropped_examples``, ``dropped_tokens``)."""
        raw, data, _ = self._load()
        if sample is not None:
            data = data.select(range(min(sample, len(data))))
        table = self._tokenize_pairs(data, raw, self.split, "train", None).with_format("arrow")[:]
        self.token_counts["train"] = _counts(table, self._fits(table))
        return _sequence_lengths(table).ravel()

    @property
    def dropped_pairs(self) -> str:
        """Which pairs training drops at ``max_length``, in words (for logs)."""
        if self.long_pairs == "drop":
            return f"with a sequence longer than max_length={self.max_length} tokens (long_pairs='drop')"
        return f"whose prompt alone has max_length={self.max_length} tokens or more, leaving no completion token"

    def _fits(self, table: Any) -> np.ndarray:
        """``[pairs]``: whether a pair is trained: its prompt (as cut by ``max_prompt_length``) leaves room for a
        completion token; with ``long_pairs="drop"``, both its sequences have at most ``max_length`` tokens."""
        if self.long_pairs == "drop":
            return (_sequence_lengths(table) <= self.max_length).all(axis=1)
        return _lengths(table, "prompt_ids") < self.max_length

    # ------------------------------------------------------------------------------------------- hooks

    def collator(self) -> PreferenceCollator:
        return PreferenceCollator(self.tokenizer.pad_token_id, self.pad_to_multiple_of, self.padding_free)

    # ----------------------------------------------------------------------------- reference log-probs

    def has_reference_logps(self, split: str) -> bool:
        """Whether ``split`` (``"train"`` or ``"validation"``) carries reference log-probabilities."""
        return all(c in self.datasets[split].column_names for c in REFERENCE_COLUMNS)

    def reference_dataloader(self, split: str, num_replicas: int = 1, rank: int = 0) -> DataLoader:
        """Batches of ``split`` in order for one pass of the reference model: this rank's pairs ``rank``,
        ``rank + num_replicas``, ..., the last one repeated so that every rank runs as many batches (ranks of a
        sharded model must run every forward together)."""
        size = len(self.datasets[split])
        per_rank = -(-size // num_replicas)
        indices = [min(rank + i * num_replicas, size - 1) for i in range(per_rank)]
        return DataLoader(
            self.datasets[split].select(indices),
            batch_size=self.val_batch_size,
            shuffle=False,
            collate_fn=self.collator(),
        )

    def set_reference_logps(self, split: str, chosen: Tensor, rejected: Tensor) -> None:
        """Store the reference log-probabilities of every pair of ``split`` (in dataset order) as its
        ``ref_chosen_logps`` / ``ref_rejected_logps`` columns, which the collator puts in every batch."""
        dataset = self.datasets[split]
        if chosen.shape != (len(dataset),) or rejected.shape != (len(dataset),):
            raise ValueError(
                f"Expected one reference log-probability per pair of the {split} split ({len(dataset)}), got "
                f"{tuple(chosen.shape)} and {tuple(rejected.shape)}."
            )
        dataset = dataset.remove_columns([c for c in REFERENCE_COLUMNS if c in dataset.column_names])
        for name, values in zip(REFERENCE_COLUMNS, (chosen, rejected)):
            dataset = dataset.add_column(name, values.double().cpu().numpy().tolist())
        self.datasets[split] = dataset


def _sequence_lengths(table: Any) -> np.ndarray:
    """``[pairs, 2]``: the tokens of each pair's prompt + chosen and prompt + rejected sequence."""
    prompts = _lengths(table, "prompt_ids")
    return np.stack([prompts + _lengths(table, "chosen_ids"), prompts + _lengths(table, "rejected_ids")], axis=1)


def _counts(table: Any, fits: np.ndarray) -> TokenCounts:
    """Tokens of both sequences of every pair: as read (``num_tokens``), kept and cut in the pairs that fit, and
    read in the pairs dropped."""
    read, kept = table.column("num_tokens").to_numpy(), _sequence_lengths(table).sum(axis=1)
    return TokenCounts(
        examples=len(table),
        tokens=int(read.sum()),
        kept_tokens=int(kept[fits].sum()),
        truncated_tokens=int((read - kept)[fits].sum()),
        dropped_examples=int((~fits).sum()),
        dropped_tokens=int(read[~fits].sum()),
    )


def _lengths(table: Any, column: str) -> np.ndarray:
    from lit_memtrain.datamodules.arrow_lists import list_lengths

    return list_lengths(table.column(column)).astype(np.int64)
