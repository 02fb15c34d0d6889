"""PromptDataModule: prompts for online RL (GRPO, RLOO), tokenized whole (or cut to ``max_prompt_length``).

Why its own datamodule: an RL step starts from prompts alone; the completions are generated in the step and the
rewards computed from them and from the other columns of each row (an ``answer`` the reward function checks, a
test suite...). So a batch keeps, beside each prompt's token ids, the prompt as the dataset gave it (a string or
chat messages, what TRL passes to reward functions) and every other column, untouched.

Prompts are tokenized whole by default, as TRL 1.16's ``GRPOTrainer`` tokenizes them (it has no prompt cut). With
``max_prompt_length`` set, longer prompts are cut (their last tokens kept by default, nearest the answer), counted,
and the count logged per split: never silently.
"""

# No `from __future__ import annotations`: with every annotation a string, jsonargparse evaluates those of
# `PromptDataModule.__init__` by running this module's TYPE_CHECKING block, which imports datasets and
# pandas (0.4 s of every `lit-memtrain plan`, which reads no data). `Dataset` is quoted where it annotates.
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lit_memtrain.datamodules.batch import SCORED, scored_column
from lit_memtrain.datamodules.code_fingerprint import data_code_fingerprint
from lit_memtrain.datamodules.embedded import EMBEDDED, embedded_prompt_path
from lit_memtrain.datamodules.prompt_tokenize import PromptTruncation, detect_prompt_format, tokenize_prompt
from lit_memtrain.datamodules.resumable import ResumableDataLoader
from lit_memtrain.datamodules.sources import RawData
from lit_memtrain.datamodules.splits import check_validation_args, load_splits
from lit_memtrain.datamodules.tokenize import tokenize_located, truncation_warning
from lit_memtrain.datamodules.tokenized_splits import TokenizedSplitsDataModule
from lit_memtrain.datamodules.tokenizer import load_tokenizer

if TYPE_CHECKING:
    from datasets import Dataset

__all__ = ["PromptCollator", "PromptCounts", "PromptDataModule"]


@dataclass(frozen=True)
class PromptCounts:
    """Prompts and prompt tokens of a split, as read and as kept."""

    prompts: int
    tokens: int
    truncated_prompts: int
    truncated_tokens: int

    def describe(self, max_prompt_length: int | None, prompt_truncation: str) -> str:
        """One line for the log."""
        text = f"{self.prompts:,} prompts, {self.tokens:,} tokens"
        if max_prompt_length is None:
            return text
        share = f" ({100 * self.truncated_tokens / self.tokens:.1f}%)" if self.tokens else ""
        kept = "end" if prompt_truncation == "keep_end" else "start"
        return (
            f"{text}: {self.truncated_prompts:,} prompts longer than max_prompt_length={max_prompt_length} cut by "
            f"{self.truncated_tokens:,} tokens{share}, keeping their {kept}"
        )


class PromptCollator:
    """A batch of prompts: ``prompt_ids`` (token ids, lists), ``prompt`` (as the dataset holds it: strings or chat
    messages) and ``columns`` (every other column, a list per column), one entry per prompt; and ``scored``
    (``BoolTensor``, one per prompt) when a prompt is a validation repeat
    (:func:`~lit_memtrain.datamodules.batch.scored_column`).

    Example:
        >>> PromptCollator(["answer"])([{"prompt": "1 + 1 =", "prompt_ids": [5, 6], "answer": "2"}])
        {'prompt': ['1 + 1 ='], 'prompt_ids': [[5, 6]], 'columns': {'answer': ['2']}}
    """

    def __init__(self, columns: Sequence[str]) -> None:
        self.columns = list(columns)

    def __call__(self, rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        if len(rows) == 0:
            raise ValueError("PromptCollator got an empty list of prompts.")
        batch = {
            "prompt": [row["prompt"] for row in rows],
            "prompt_ids": [list(row["prompt_ids"]) for row in rows],
            "columns": {name: [row[name] for row in rows] for name in self.columns},
        }
        scored = scored_column(rows)
        if scored is not None:
            batch[SCORED] = scored
        return batch



class PromptDataModule(TokenizedSplitsDataModule):
    """Prompts for GRPO / RLOO in TRL's prompt-only formats, with the columns the reward functions read.

    Args:
        tokenizer: hub id or local path of a tokenizer, or ``"lit-memtrain/embedded"``.
        dataset: hub dataset name, local file or directory, an in-memory ``datasets.Dataset``, or
            ``"lit-memtrain/embedded"`` (two-digit additions, conversational, with their ``answer``).
        dataset_config, data_files, split: as for :class:`~lit_memtrain.datamodules.sft.SFTDataModule`.
        max_prompt_length: tokens kept of each prompt (``None``, the default: all, as TRL 1.16, which has no such
            option); longer prompts are cut and counted. The memory planner needs it set: the longest prompt it plans.
        prompt_truncation: which tokens ``max_prompt_length`` keeps: ``keep_end`` (the last, nearest the answer) or
            ``keep_start``.
        chat_template_kwargs: TRL's: keyword arguments of the chat template that renders conversational prompts
            (e.g. ``{"enable_thinking": False}`` for Qwen3).
        val_size: fraction (< 1) or number (>= 1) of training prompts held out for validation.
        val_split: name of an existing split to validate on instead.
        batch_size: prompts per batch on each rank (each gets the module's ``num_generations`` completions: TRL's
            ``per_device_train_batch_size`` counts completions instead); ``val_batch_size`` defaults to it.
        drop_last: train only whole batches (``batch_size`` prompts on every rank): an epoch's last, smaller batch
            is dropped, as TRL's ``RepeatSampler`` drops an incomplete generation batch (default True). False trains
            it too (a batch of fewer prompts: another size of group statistics and of the DAPO normaliser).
        num_workers: DataLoader workers.
        num_proc: processes for tokenization with ``datasets.map``.
        seed: seed of the training shuffle and of the validation hold-out.

    Example:
        >>> dm = PromptDataModule(tokenizer="lit-memtrain/embedded", dataset="lit-memtrain/embedded", batch_size=8)
        >>> trainer.fit(GRPOModule(preset="tiny-qwen3", reward_funcs=[...]), datamodule=dm)  # doctest: +SKIP
    """

    unit = "prompts"

    def __init__(
        self,
        tokenizer: str = EMBEDDED,
        dataset: str | Any = EMBEDDED,
        dataset_config: str | None = None,
        data_files: str | list[str] | dict[str, Any] | None = None,
        split: str = "train",
        max_prompt_length: int | None = None,
        prompt_truncation: PromptTruncation = "keep_end",
        chat_template_kwargs: dict[str, Any] | None = None,
        val_size: float = 0.0,
        val_split: str | None = None,
        batch_size: int = 8,
        val_batch_size: int | None = None,
        drop_last: bool = True,
        num_workers: int = 0,
        num_proc: int | None = None,
        seed: int = 42,
    ) -> None:
        super().__init__()
        if max_prompt_length is not None and (isinstance(max_prompt_length, bool) or max_prompt_length < 1):
            raise ValueError(f"max_prompt_length must be at least 1 token or None, got {max_prompt_length}.")
        if prompt_truncation not in ("keep_start", "keep_end"):
            raise ValueError(f"prompt_truncation must be 'keep_start' or 'keep_end', got {prompt_truncation!r}.")
        if batch_size < 1 or (val_batch_size is not None and val_batch_size < 1):
            raise ValueError(
                f"batch_size and val_batch_size must be at least 1 prompt, got {batch_size} and {val_batch_size}."
            )
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
            raise TypeError(
                f"chat_template_kwargs must be a dict of the chat template's arguments, got {chat_template_kwargs!r}."
            )
        check_validation_args(val_size, val_split)
        self.save_hyperparameters(ignore=["dataset"] if not isinstance(dataset, str) else None)
        self.tokenizer_name = tokenizer
        self.dataset = dataset
        self.dataset_config = dataset_config
        self.data_files = data_files
        self.split = split
        self.max_prompt_length = max_prompt_length
        self.prompt_truncation = prompt_truncation
        self.chat_template_kwargs = chat_template_kwargs
        self.val_size = val_size
        self.val_split = val_split
        self.batch_size = batch_size
        self.val_batch_size = val_batch_size or batch_size
        self.drop_last = drop_last
        self.num_workers = num_workers
        self.num_proc = num_proc
        self.seed = seed
        self.tokenizer = load_tokenizer(tokenizer)
        self.datasets: dict[str, Dataset] = {}
        self.prompt_counts: dict[str, PromptCounts] = {}
        self.reward_columns: list[str] = []

    def _load(self) -> tuple[RawData, Any, Any]:
        dataset = embedded_prompt_path() if self.dataset == EMBEDDED else self.dataset
        return load_splits(
            dataset, self.dataset_config, self.data_files, self.split, self.val_split, val_split_label="Split"
        )

    def _tokenize(self, data: "Dataset", raw: RawData, split: str, name: str) -> "Dataset":
        """Tokenize and cut a split's prompts; count and log them."""
        try:
            columns = detect_prompt_format(list(data.column_names))
        except ValueError as error:
            raise ValueError(f"The {split} split{raw.describe(split)}: {error}") from None
        tokenized = data.map(
            tokenize_located,
            with_indices=True,
            fn_kwargs={
                "locator": raw.locator(split),
                "tokenize": tokenize_prompt,
                "data_code": data_code_fingerprint(),
                "tokenizer": self.tokenizer,
                "max_prompt_length": self.max_prompt_length,
                "prompt_truncation": self.prompt_truncation,
                "chat_template_kwargs": self.chat_template_kwargs,
            },
            num_proc=self.num_proc,
            desc=f"Tokenizing {name} (prompts)",
        )
        table = tokenized.with_format("arrow")[:]
        read = table.column("num_tokens").to_numpy()
        kept = read if self.max_prompt_length is None else read.clip(max=self.max_prompt_length)
        counts = self.prompt_counts[name] = PromptCounts(
            prompts=len(read), tokens=int(read.sum()), truncated_prompts=int((read > kept).sum()),
            truncated_tokens=int((read - kept).sum()),
        )  # fmt: skip
        rank_zero_info(f"{name}: {counts.describe(self.max_prompt_length, self.prompt_truncation)}.")
        warning = truncation_warning(
            counts.truncated_tokens, counts.tokens, f"{name} prompts", f"max_prompt_length={self.max_prompt_length}",
            "a larger --data.max_prompt_length, or none (max_prompt_length: null)",
        )  # fmt: skip
        if warning:
            rank_zero_warn(warning)
        self.reward_columns = columns
        return tokenized.select_columns(["prompt", "prompt_ids", *columns])

    def train_dataloader(self) -> ResumableDataLoader:
        prompts, (ranks, _) = len(self.datasets["train"]), self.data_parallel()
        if self.drop_last and prompts < self.batch_size * ranks:
            raise ValueError(
                f"The training split has {prompts} prompts, fewer than one whole batch (batch_size={self.batch_size} "
                f"x {ranks} ranks), and drop_last=True drops incomplete batches: an epoch would train nothing. Use a "
                "smaller batch_size, more prompts, or drop_last=False."
            )
        return self.resumable_train_loader(
            self.datasets["train"], self.batch_size, self.collator(), self.seed, self.num_workers, self.drop_last
        )

    def collator(self) -> PromptCollator:
        return PromptCollator(self.reward_columns)

