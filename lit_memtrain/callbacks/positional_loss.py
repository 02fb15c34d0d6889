"""PositionalLoss: validation loss by position in the document, against the data's unigram entropy.

Why: one validation loss hides *where* a model struggles along the sequence. Per-position loss is the
diagnostic for context extension (TRL's long-context guide shows YaRN this way): with working RoPE
scaling the curve stays flat or falls with position; without it the loss climbs past the trained context.
The unigram entropy of the targets is the reference line: the loss of a model that only knows token
frequencies, in nats like the loss, so a curve that reaches it has stopped using context at all.

Each validation run (the sanity check excepted) writes ``loss_by_position_step<N>.csv`` and ``.png`` into
``output_dir``, one pair per run named by the global step, so the curve's history over training is kept;
a second run at the same step (``trainer.validate`` twice) overwrites its pair. Sums and counts are kept
per position and summed across ranks before bucketing, so every rank's tokens are counted once.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Mapping
from dataclasses import astuple, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import WandbLogger
from torch import Tensor
from typing_extensions import override

from lit_memtrain.datamodules.batch import IGNORE_INDEX, batch_targets

if TYPE_CHECKING:  # imported where a plot is drawn: GPU machines may lack matplotlib
    from matplotlib.figure import Figure

DEFAULT_NUM_BUCKETS = 32


@dataclass(frozen=True)
class PositionBucket:
    """Validation tokens whose position lies in ``[start, end)``, and their mean loss in nats."""

    start: int
    end: int
    mean_loss: float
    tokens: int


def bucket_losses(loss_sums: Tensor, counts: Tensor, bucket_width: int) -> list[PositionBucket]:
    """Group per-position loss sums and token counts (index = position) into buckets; empty buckets are left out."""
    num_buckets = -(-loss_sums.numel() // bucket_width)
    padding = num_buckets * bucket_width - loss_sums.numel()
    sums = F.pad(loss_sums.double().cpu(), (0, padding)).view(num_buckets, bucket_width).sum(1)
    tokens = F.pad(counts.cpu(), (0, padding)).view(num_buckets, bucket_width).sum(1)
    return [
        PositionBucket(i * bucket_width, (i + 1) * bucket_width, (sums[i] / tokens[i]).item(), int(tokens[i]))
        for i in range(num_buckets)
        if tokens[i] > 0
    ]


def unigram_entropy(token_counts: Tensor) -> float:
    """Entropy in nats of the empirical token distribution given by ``token_counts`` (index = token id)."""
    counts = token_counts[token_counts > 0].double()
    probabilities = counts / counts.sum()
    return float(-(probabilities * probabilities.log()).sum())


def plot_loss_by_position(buckets: list[PositionBucket], entropy: float) -> Figure:
    """Mean loss at each bucket's midpoint, with the unigram entropy as a horizontal reference line."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 4), dpi=100)
    axes = figure.add_subplot()
    midpoints = [(bucket.start + bucket.end) / 2 for bucket in buckets]
    axes.plot(midpoints, [bucket.mean_loss for bucket in buckets], marker="o", label="mean loss")
    axes.axhline(entropy, color="gray", linestyle="--", label=f"unigram entropy ({entropy:.3f})")
    axes.set_xlabel("position in document (bucket midpoint)")
    axes.set_ylabel("validation loss (nats)")
    axes.legend()
    figure.tight_layout()
    return figure


def write_buckets_csv(buckets: list[PositionBucket], path: Path) -> None:
    """Columns ``start, end, mean_loss, tokens`` (``end`` exclusive); floats written exactly (repr)."""
    with path.open("w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow([field.name for field in fields(PositionBucket)])
        writer.writerows(astuple(bucket) for bucket in buckets)


def _grow(values: Tensor, size: int) -> Tensor:
    return values if values.numel() >= size else F.pad(values, (0, size - values.numel()))


class PositionalLoss(Callback):
    """Per-position validation loss, bucketed, written as CSV + PNG and logged, with the unigram entropy.

    Needs ``validation_step`` to return a dict with ``token_losses`` (1-D, one loss per trained target token)
    and ``token_positions`` (1-D, each of those tokens' position in its document), as
    :class:`~lit_memtrain.objectives.causal_lm.CausalLMModule` does, and validation batches with unshifted ``labels``
    (-100 = not trained) from which the target-token frequencies are counted, or, for the sequence shards of
    :class:`~lit_memtrain.strategies.ContextParallelStrategy`, their ``shift_labels`` (shifted on the whole row).

    Args:
        bucket_width: positions per bucket. Give this or ``num_buckets``, not both.
        num_buckets: split the positions seen (0 to the largest) into this many equal buckets; the default
            when neither is given is 32.
        output_dir: where the CSV and PNG go; default ``trainer.log_dir`` (the logger's directory, else
            ``default_root_dir``) plus ``/positional_loss``.

    Logging: to a :class:`~lightning.pytorch.loggers.WandbLogger` as a ``wandb.Table``
    (``val/loss_by_position``) and a ``wandb.Image`` (``val/loss_by_position_plot``); to any other logger as
    one scalar per bucket, ``val/loss_by_position/<start>-<end>``. ``val/unigram_entropy`` goes to all.

    Example:
        >>> trainer = Trainer(callbacks=[PositionalLoss(bucket_width=4096)])  # doctest: +SKIP
        >>> trainer.validate(CausalLMModule(model="Qwen/Qwen3-0.6B"), datamodule=dm)  # doctest: +SKIP
    """

    def __init__(
        self, bucket_width: int | None = None, num_buckets: int | None = None, output_dir: str | None = None
    ) -> None:
        if bucket_width is not None and num_buckets is not None:
            raise ValueError(
                f"Give bucket_width or num_buckets, not both "
                f"(got bucket_width={bucket_width}, num_buckets={num_buckets})."
            )
        if bucket_width is not None and bucket_width < 1:
            raise ValueError(f"bucket_width must be a positive number of positions, got {bucket_width}.")
        if num_buckets is not None and num_buckets < 1:
            raise ValueError(f"num_buckets must be a positive number, got {num_buckets}.")
        self.bucket_width = bucket_width
        self.num_buckets = num_buckets or (None if bucket_width else DEFAULT_NUM_BUCKETS)
        self.output_dir = output_dir
        self._directory: Path | None = None
        self._reset(torch.device("cpu"))

    def _reset(self, device: torch.device) -> None:
        # MPS has no float64; elsewhere sums of many float32 losses keep their precision in float64.
        dtype = torch.float32 if device.type == "mps" else torch.float64
        self._loss_sums = torch.zeros(0, dtype=dtype, device=device)
        self._counts = torch.zeros(0, dtype=torch.long, device=device)
        self._token_counts = torch.zeros(0, dtype=torch.long, device=device)

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        # trainer.log_dir broadcasts, so it is resolved here, on every rank.
        default = Path(trainer.log_dir or trainer.default_root_dir, "positional_loss")
        self._directory = Path(self.output_dir) if self.output_dir else default

    @override
    def on_validation_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._reset(pl_module.device)

    @override
    def on_validation_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if trainer.sanity_checking:
            return
        keys = list(outputs) if isinstance(outputs, Mapping) else []
        missing = [key for key in ("token_losses", "token_positions") if key not in keys]
        if missing:
            raise ValueError(
                f"PositionalLoss needs {type(pl_module).__name__}.validation_step to return a dict with "
                "'token_losses' (1-D loss of each trained target token) and 'token_positions' (1-D position of each "
                f"of those tokens in its document); missing {missing}, got "
                f"{keys if isinstance(outputs, Mapping) else type(outputs).__name__}. CausalLMModule returns both."
            )
        if not isinstance(batch, Mapping) or not ({"labels", "shift_labels"} & set(batch)):
            found = list(batch) if isinstance(batch, Mapping) else type(batch).__name__
            raise ValueError(
                "PositionalLoss counts the target tokens from the validation batch's 'labels' (unshifted, -100 = "
                f"not trained) or its 'shift_labels' (shifted), but the batch has neither: got {found}."
            )
        losses, positions = outputs["token_losses"].detach().flatten(), outputs["token_positions"].flatten().long()
        if losses.numel() != positions.numel():
            raise ValueError(
                "token_losses and token_positions must have one entry per token; "
                f"got {losses.numel()} and {positions.numel()}."
            )
        if positions.numel():
            size = int(positions.max()) + 1
            self._loss_sums = _grow(self._loss_sums, size).index_add(0, positions, losses.to(self._loss_sums.dtype))
            self._counts = _grow(self._counts, size).index_add(0, positions, torch.ones_like(positions))
        targets = batch_targets(batch).flatten()
        targets = targets[targets != IGNORE_INDEX]
        if targets.numel():
            vocabulary = max(int(targets.max()) + 1, self._token_counts.numel())
            self._token_counts = _grow(self._token_counts, vocabulary) + torch.bincount(targets, minlength=vocabulary)

    def _sum_across_ranks(self, trainer: Trainer) -> tuple[Tensor, Tensor, Tensor]:
        sizes = torch.tensor([self._counts.numel(), self._token_counts.numel()], device=self._counts.device)
        positions, vocabulary = trainer.strategy.all_gather(sizes).reshape(-1, 2).amax(0).tolist()
        return (
            trainer.strategy.reduce(_grow(self._loss_sums, positions), reduce_op="sum"),
            trainer.strategy.reduce(_grow(self._counts, positions), reduce_op="sum"),
            trainer.strategy.reduce(_grow(self._token_counts, vocabulary), reduce_op="sum"),
        )

    @override
    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking:
            return
        loss_sums, counts, token_counts = self._sum_across_ranks(trainer)
        self._reset(pl_module.device)
        if not trainer.is_global_zero or not counts.sum():
            return
        width = self.bucket_width or math.ceil(counts.numel() / self.num_buckets)
        buckets = bucket_losses(loss_sums, counts, width)
        entropy = unigram_entropy(token_counts)
        step = trainer.global_step
        self._directory.mkdir(parents=True, exist_ok=True)
        csv_path = self._directory / f"loss_by_position_step{step}.csv"
        png_path = self._directory / f"loss_by_position_step{step}.png"
        write_buckets_csv(buckets, csv_path)
        plot_loss_by_position(buckets, entropy).savefig(png_path)
        self._log(trainer, buckets, entropy, png_path)

    @staticmethod
    def _log(trainer: Trainer, buckets: list[PositionBucket], entropy: float, png_path: Path) -> None:
        step = trainer.global_step
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                import wandb

                columns = [field.name for field in fields(PositionBucket)]
                table = wandb.Table(columns=columns, data=[list(astuple(bucket)) for bucket in buckets])
                logger.experiment.log(
                    {
                        "val/loss_by_position": table,
                        "val/loss_by_position_plot": wandb.Image(str(png_path)),
                        "val/unigram_entropy": entropy,
                        "trainer/global_step": step,
                    }
                )
            else:
                scalars = {f"val/loss_by_position/{b.start}-{b.end}": b.mean_loss for b in buckets}
                logger.log_metrics({**scalars, "val/unigram_entropy": entropy}, step=step)
