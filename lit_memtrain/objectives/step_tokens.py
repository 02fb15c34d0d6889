"""Counting the trainable tokens of a whole optimizer step before its first backward.

Why: a step's loss is the mean over every trainable target token of the step, across gradient-accumulation
micro-batches and data-parallel ranks, so that each token weighs the same however tokens fall into
micro-batches. Dividing each micro-batch's loss sum by that count *before* backward (as torchtitan and
transformers do) means every gradient anyone sees is the true one: gradient clipping, gradient-norm logging
in callbacks, fp16's GradScaler, FSDP2's reduce-scatter. The count of the step's later micro-batches is
needed at its first one, so the step's micro-batches are read ahead.

Lightning fetches one micro-batch per ``training_step`` and has no read-ahead of its own; the one public
place where a strategy wraps a training dataloader is ``Strategy.process_dataloader``, so
:func:`count_step_tokens_during_fit` wraps it there, with :class:`StepTokenCounts`. The step boundaries
are Lightning's own: a step ends every ``accumulate_grad_batches`` batches of the epoch and at the epoch's
last batch (``limit_train_batches`` included), counted from where a resumed epoch restarts.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Iterator, MutableMapping
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from lit_memtrain.datamodules.batch import STEP_TRAINABLE_TOKENS

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "STEP_TRAINABLE_TOKENS",
    "StepTokenCounts",
    "count_step_tokens_during_fit",
    "micro_batch_mean",
    "step_trainable_tokens",
]
_OWN_ATTRIBUTES = ("loader", "micro_batches_per_step", "count", "epoch_position")


class StepTokenCounts:
    """Batches of ``loader``, each tagged with the trainable tokens of its whole optimizer step on this rank.

    Reads the micro-batches of one optimizer step ahead, counts each with ``count`` and stores the step's
    sum under ``batch["step_trainable_tokens"]`` (an int) before yielding them one by one.

    Args:
        loader: the training dataloader (or any iterable of dict batches).
        micro_batches_per_step: gradient-accumulation micro-batches per optimizer step.
        count: trainable target tokens of one batch.
        epoch_position: called when an epoch's iteration starts: batches of the epoch already trained (a
            resumed epoch) and batches the epoch will train (``math.inf`` when unknown).

    Example:
        >>> batches = [{"n": 3}, {"n": 1}, {"n": 2}]
        >>> [b["step_trainable_tokens"] for b in StepTokenCounts(batches, 2, lambda b: b["n"])]
        [4, 4, 2]
    """

    def __init__(
        self,
        loader: Iterable[Any],
        micro_batches_per_step: int,
        count: Callable[[Any], int],
        epoch_position: Callable[[], tuple[int, float]] = lambda: (0, math.inf),
    ) -> None:
        if isinstance(micro_batches_per_step, bool) or not isinstance(micro_batches_per_step, int):
            raise TypeError(f"micro_batches_per_step must be an int, got {micro_batches_per_step!r}.")
        if micro_batches_per_step < 1:
            raise ValueError(f"micro_batches_per_step must be >= 1, got {micro_batches_per_step}.")
        self.loader = loader
        self.micro_batches_per_step = micro_batches_per_step
        self.count = count
        self.epoch_position = epoch_position

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        # Lightning reads and sets the loader's sampler, batch_sampler, worker_init_fn through the wrapper.
        if name in _OWN_ATTRIBUTES:
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _OWN_ATTRIBUTES:
            object.__setattr__(self, name, value)
        else:
            setattr(self.loader, name, value)

    def __iter__(self) -> Iterator[Any]:
        done, total = self.epoch_position()
        batches = iter(self.loader)
        per_step = self.micro_batches_per_step
        while done < total:
            step_end = min(total, (done // per_step + 1) * per_step)
            wanted = int(step_end - done)
            step = list(itertools.islice(batches, wanted))
            if not step:
                return
            tokens = 0
            for batch in step:
                if not isinstance(batch, MutableMapping):
                    raise TypeError(
                        f"Counting a step's trainable tokens needs dict batches; the training dataloader yields "
                        f"{type(batch).__name__}."
                    )
                tokens += int(self.count(batch))
            for batch in step:
                batch[STEP_TRAINABLE_TOKENS] = tokens
            yield from step
            if len(step) < wanted:
                return
            done += wanted


def _epoch_position(trainer: pl.Trainer) -> tuple[int, float]:
    done = trainer.fit_loop.epoch_loop.batch_progress.current.ready
    total = trainer.num_training_batches
    if isinstance(trainer.limit_train_batches, int):  # also binds loaders of unknown length
        total = min(total, trainer.limit_train_batches)
    return done, total


def count_step_tokens_during_fit(trainer: pl.Trainer, count: Callable[[Any], int]) -> Callable[[], None]:
    """Make ``trainer`` tag every training batch with its optimizer step's trainable tokens (this rank's).

    Wraps the training dataloader in :class:`StepTokenCounts` where the strategy processes it
    (``process_dataloader``, replaced on the strategy instance; validation loaders are left alone). Call it
    from a LightningModule's ``setup("fit")``; returns a function that restores the strategy.
    """
    strategy = trainer.strategy
    previous = vars(strategy).get("process_dataloader")
    process = strategy.process_dataloader

    def process_dataloader(dataloader: object) -> object:
        dataloader = process(dataloader)
        if not trainer.training:
            return dataloader
        return StepTokenCounts(dataloader, trainer.accumulate_grad_batches, count, lambda: _epoch_position(trainer))

    strategy.process_dataloader = process_dataloader

    def restore() -> None:
        if previous is None:
            del strategy.process_dataloader
        else:
            strategy.process_dataloader = previous

    return restore


def step_trainable_tokens(
    batch: dict[str, Any],
    trainer: pl.Trainer,
    count: Callable[[Any], int],
    device: torch.device,
    mesh: DeviceMesh | None = None,
) -> Tensor:
    """Trainable target tokens of ``batch``'s whole optimizer step, summed over the ranks' rows: a 0-d tensor on
    ``device``, what the step's loss sum is divided by.

    Read from the tag :func:`count_step_tokens_during_fit` puts on the batch; counted from the batch itself
    (``count``) only when a step is one micro-batch on one rank. Summed over the ``data_parallel`` dimension of
    ``mesh`` (the strategy's device mesh) when there is one, since ranks that share rows (a context-parallel
    group) count them once, else over all ranks.

    Raises:
        RuntimeError: an untagged batch of a step with several micro-batches or ranks.
    """
    if STEP_TRAINABLE_TOKENS in batch:
        tokens = batch[STEP_TRAINABLE_TOKENS]
    elif trainer.accumulate_grad_batches == 1 and trainer.world_size == 1:
        tokens = count(batch)
    else:
        raise RuntimeError(
            f"The batch has no {STEP_TRAINABLE_TOKENS!r}: with gradient accumulation or several ranks the "
            "loss is divided by the trainable tokens of the whole optimizer step, which CausalLMModule.setup "
            "arranges for the training dataloader. Call super().setup(stage) if you override setup."
        )
    tokens = torch.tensor(tokens, device=device)
    if trainer.world_size > 1:
        group = mesh["data_parallel"].get_group() if mesh is not None else None
        tokens = trainer.strategy.reduce(tokens, group=group, reduce_op="sum")
    return tokens


def micro_batch_mean(loss_sum: Tensor, targets: Tensor, mesh: DeviceMesh | None = None) -> Tensor:
    """A micro-batch's mean token loss (what ``train/loss`` shows) from its loss sum and trainable targets; over
    the whole rows when each rank of a context-parallel group holds a shard of them (the ``context_parallel``
    dimension of ``mesh``: one all-reduce of two numbers over the group)."""
    split = mesh is not None and "context_parallel" in (mesh.mesh_dim_names or ())
    if split and mesh["context_parallel"].size() > 1:
        totals = torch.stack([loss_sum.float(), targets.float()])
        torch.distributed.all_reduce(totals, group=mesh["context_parallel"].get_group())
        loss_sum, targets = totals[0], totals[1]
    return loss_sum / targets.clamp(min=1)
