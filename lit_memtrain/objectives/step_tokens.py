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

The accumulation can change from one epoch to the next (``GradientAccumulationScheduler`` sets
``trainer.accumulate_grad_batches`` in ``on_train_epoch_start``), and Lightning makes a fit's first iterator, and
fetches its first batch from a loader of unknown length, before that hook runs: each epoch is read ahead for the
scheduler's value for it, and each batch carries the value it was read for (:class:`StepWindow`), which the
training step checks against the one in force (:func:`step_window`), refusing a count made for another.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Iterator, MutableMapping
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from torch import Tensor

from lit_memtrain.datamodules.batch import STEP_TRAINABLE_TOKENS, STEP_WINDOW

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "STEP_TRAINABLE_TOKENS",
    "STEP_WINDOW",
    "StepTokenCounts",
    "StepWindow",
    "count_step_tokens_during_fit",
    "micro_batch_mean",
    "resume_scheduled_accumulation",
    "step_trainable_tokens",
    "step_window",
]
_OWN_ATTRIBUTES = ("loader", "micro_batches_per_step", "count", "epoch_position")


class StepWindow(NamedTuple):
    """The optimizer step a training batch belongs to, as it was read ahead.

    Attributes:
        micro_batches: the step's micro-batches: ``accumulate_grad_batches``, fewer in an epoch's last, shorter
            step (and in the step a resumed epoch restarts in the middle of).
        accumulate_grad_batches: the accumulation the step's micro-batches were read ahead for.
    """

    micro_batches: int
    accumulate_grad_batches: int


class StepTokenCounts:
    """Batches of ``loader``, each tagged with the trainable tokens of its whole optimizer step on this rank.

    Reads the micro-batches of one optimizer step ahead, counts each with ``count`` and stores the step's
    sum under ``batch["step_trainable_tokens"]`` (an int) and the step itself under ``batch["step_window"]``
    (a :class:`StepWindow`) before yielding them one by one.

    Args:
        loader: the training dataloader (or any iterable of dict batches).
        micro_batches_per_step: gradient-accumulation micro-batches per optimizer step, or a function that gives
            them when an epoch's iteration starts (an accumulation that changes between epochs).
        count: trainable target tokens of one batch.
        epoch_position: called when an epoch's iteration starts: batches of the epoch already trained (a
            resumed epoch) and batches the epoch will train (``math.inf`` when unknown).

    Example:
        >>> batches = [{"n": 3}, {"n": 1}, {"n": 2}]
        >>> [b["step_trainable_tokens"] for b in StepTokenCounts(batches, 2, lambda b: b["n"])]
        [4, 4, 2]
        >>> batches[2]["step_window"]
        StepWindow(micro_batches=1, accumulate_grad_batches=2)
    """

    def __init__(
        self,
        loader: Iterable[Any],
        micro_batches_per_step: int | Callable[[], int],
        count: Callable[[Any], int],
        epoch_position: Callable[[], tuple[int, float]] = lambda: (0, math.inf),
    ) -> None:
        if not callable(micro_batches_per_step):
            _check_micro_batches_per_step(micro_batches_per_step)
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
        per_step = self.micro_batches_per_step
        per_step = _check_micro_batches_per_step(per_step() if callable(per_step) else per_step)
        done, total = self.epoch_position()
        batches = iter(self.loader)
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
            window = StepWindow(len(step), per_step)
            for batch in step:
                batch[STEP_TRAINABLE_TOKENS] = tokens
                batch[STEP_WINDOW] = window
            yield from step
            if len(step) < wanted:
                return
            done += wanted


def _check_micro_batches_per_step(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"micro_batches_per_step must be an int, got {value!r}.")
    if value < 1:
        raise ValueError(f"micro_batches_per_step must be >= 1, got {value}.")
    return value


def _epoch_position(trainer: pl.Trainer) -> tuple[int, float]:
    done = trainer.fit_loop.epoch_loop.batch_progress.current.ready
    total = trainer.num_training_batches
    if isinstance(trainer.limit_train_batches, int):  # also binds loaders of unknown length
        total = min(total, trainer.limit_train_batches)
    return done, total


def _scheduler(trainer: pl.Trainer) -> GradientAccumulationScheduler | None:
    return next((c for c in trainer.callbacks if isinstance(c, GradientAccumulationScheduler)), None)


def _epoch_accumulation(trainer: pl.Trainer) -> int:
    """``accumulate_grad_batches`` of the epoch whose batches are being read.

    Lightning makes the first iterator of a fit (and of a resumed fit), and fetches the first batch of a loader of
    unknown length, before ``on_train_epoch_start``, where a ``GradientAccumulationScheduler`` sets the epoch's
    value: the scheduler's value for the epoch is read rather than the Trainer's, still the previous one there. Any
    other change is caught by :func:`step_window` at the training step.
    """
    scheduler = _scheduler(trainer)
    if scheduler is not None:
        return scheduler.get_accumulate_grad_batches(trainer.current_epoch)
    return trainer.accumulate_grad_batches


def resume_scheduled_accumulation(trainer: pl.Trainer) -> None:
    """Put in force the ``GradientAccumulationScheduler``'s accumulation of the epoch a fit starts in; call it from
    ``on_train_start``.

    Why: Lightning does not call ``on_train_epoch_start`` for an epoch it resumes in the middle of, so the
    scheduler does not set that epoch's value, and the rest of the epoch would accumulate the Trainer's own
    ``accumulate_grad_batches`` instead, unlike the run it resumes (and unlike the steps read ahead for the
    epoch, which :func:`step_window` would refuse). A fit that starts an epoch gets the same value from the
    scheduler again.
    """
    scheduler = _scheduler(trainer)
    if scheduler is not None:
        trainer.accumulate_grad_batches = scheduler.get_accumulate_grad_batches(trainer.current_epoch)


def count_step_tokens_during_fit(trainer: pl.Trainer, count: Callable[[Any], int]) -> Callable[[], None]:
    """Make ``trainer`` tag every training batch with its optimizer step's trainable tokens (this rank's) and
    its :class:`StepWindow`.

    Wraps the training dataloader in :class:`StepTokenCounts` where the strategy processes it
    (``process_dataloader``, replaced on the strategy instance; validation loaders are left alone). Each epoch's
    steps follow that epoch's ``accumulate_grad_batches`` (a ``GradientAccumulationScheduler``'s included). Call it
    from a LightningModule's ``setup("fit")``; returns a function that restores the strategy.
    """
    strategy = trainer.strategy
    previous = vars(strategy).get("process_dataloader")
    process = strategy.process_dataloader

    def process_dataloader(dataloader: object) -> object:
        dataloader = process(dataloader)
        if not trainer.training:
            return dataloader
        return StepTokenCounts(
            dataloader, lambda: _epoch_accumulation(trainer), count, lambda: _epoch_position(trainer)
        )

    strategy.process_dataloader = process_dataloader

    def restore() -> None:
        if previous is None:
            del strategy.process_dataloader
        else:
            strategy.process_dataloader = previous

    return restore


def step_window(batch: dict[str, Any], trainer: pl.Trainer) -> StepWindow:
    """The optimizer step ``batch`` belongs to, checked against the ``accumulate_grad_batches`` in force.

    Read from the tag :func:`count_step_tokens_during_fit` puts on the batch; a step of one micro-batch when the
    batch is untagged and nothing accumulates.

    Raises:
        RuntimeError: the batch's step was read ahead for another accumulation than the one in force (the count
            it carries is another step's), or an untagged batch while micro-batches accumulate.
    """
    in_force = trainer.accumulate_grad_batches
    window = batch.get(STEP_WINDOW)
    if window is None:
        if in_force == 1:
            return StepWindow(1, 1)
        raise RuntimeError(
            f"The batch has no {STEP_WINDOW!r}: with gradient accumulation the loss is scaled for the whole "
            "optimizer step, which the module's setup arranges for the training dataloader. Call "
            "super().setup(stage) if you override setup."
        )
    if window.accumulate_grad_batches != in_force:
        raise RuntimeError(
            f"This batch's optimizer step was read ahead for accumulate_grad_batches="
            f"{window.accumulate_grad_batches}, but {in_force} is in force at its training_step: its loss would be "
            "divided by the count of another step. A fit's first step is read ahead before Lightning calls "
            "on_train_epoch_start: change the accumulation between epochs with Lightning's "
            "GradientAccumulationScheduler (its value for each epoch is known ahead), not by setting "
            "trainer.accumulate_grad_batches in a hook."
        )
    return window


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
        RuntimeError: an untagged batch of a step with several micro-batches or ranks, or a count made for another
            accumulation than the one in force (:func:`step_window`).
    """
    if STEP_TRAINABLE_TOKENS in batch:
        step_window(batch, trainer)
        tokens = batch[STEP_TRAINABLE_TOKENS]
    elif trainer.accumulate_grad_batches == 1 and trainer.world_size == 1:
        tokens = count(batch)
    else:
        raise RuntimeError(
            f"The batch has no {STEP_TRAINABLE_TOKENS!r}: with gradient accumulation or several ranks the "
            "loss is divided by the trainable tokens of the whole optimizer step, which CausalLMModule.setup "
            "arranges for the training dataloader. Call super().setup(stage) if you override setup."
        )
    # Filled on the device: torch.tensor(tokens, device=cuda) copies from pageable host memory, which waits for all
    # the work queued on the device (a sync every step); a fill is queued like any kernel.
    tokens = torch.full((), int(tokens), dtype=torch.int64, device=device)
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
