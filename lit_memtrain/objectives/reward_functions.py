"""Calling reward functions with TRL's signature, and refusing what they return when it is not one number each.

Why a class of its own: the reward functions are user code, the one place of an RL step the project does not
control, and a wrong value there (a list one short, a string, an ``inf``) would otherwise become a wrong advantage
silently, or an error deep in a tensor constructor that names neither the function nor the batch. Here every call
is checked and every error says which function, on which batch, returned or raised what.

A reward function is any callable with TRL's signature::

    def reward(prompts, completions, completion_ids, **kwargs) -> list[float | None]

``prompts`` and ``completions`` are strings (standard data) or lists of chat messages (conversational data: the
completion is ``[{"role": "assistant", "content": text}]``), ``completion_ids`` the generated token ids, and the
keyword arguments every other column of the prompt dataset (one value per completion) plus ``trainer_state`` (the
Hugging Face ``TrainerState`` fields :class:`TrainerState` lists), ``log_metric(name, value)`` (a scalar logged as
``train/<name>``) and ``log_extra(column, values)`` (TRL's: one value per completion, kept for this generation batch
in :attr:`~lit_memtrain.objectives.grpo.GRPOModule.completion_extras`; lit-memtrain has no completions table).
``None`` means "not scored" (the completion is left out of its group's statistics); a trained reward model is one
such function. A function may be given as an import path (``"my_rewards.accuracy"``), which is how a YAML config
names it.
"""

from __future__ import annotations

import importlib
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = ["RewardFunctions", "TrainerState", "resolve_reward_function"]


@dataclass(frozen=True)
class TrainerState:
    """The fields of the Hugging Face ``TrainerState`` (what TRL passes as ``trainer_state``) that reward functions
    read to shape rewards over training, with their meanings there.

    Attributes:
        global_step: optimizer steps taken.
        epoch: epochs done, fractional (``2.5``: halfway through the third), as the Hugging Face Trainer counts it.
        max_steps: the optimizer steps of the run (Lightning's ``max_steps``, -1 when the run is bounded by epochs).
        num_train_epochs: the run's epochs (Lightning's ``max_epochs``).
        is_local_process_zero, is_world_process_zero: whether this process is the first of its machine, of all.
    """

    global_step: int
    epoch: float
    max_steps: int
    num_train_epochs: int = 1
    is_local_process_zero: bool = True
    is_world_process_zero: bool = True

    @classmethod
    def of(cls, trainer: Any) -> TrainerState:
        """A Lightning ``Trainer``'s state in these terms; ``epoch`` counts the batches of the current epoch that
        were trained (of its ``num_training_batches``, when known)."""
        epoch, batches = trainer.current_epoch, trainer.num_training_batches
        if trainer.training and 0 < batches < math.inf:
            epoch += trainer.fit_loop.epoch_loop.batch_progress.current.processed / batches
        return cls(
            global_step=trainer.global_step, epoch=float(epoch), max_steps=trainer.max_steps,
            num_train_epochs=trainer.max_epochs if trainer.max_epochs is not None else -1,
            is_local_process_zero=trainer.local_rank == 0, is_world_process_zero=trainer.global_rank == 0,
        )  # fmt: skip


def resolve_reward_function(spec: str | Callable[..., Any]) -> Callable[..., Any]:
    """A callable as given, or the one an import path (``"package.module.function"``) names."""
    if callable(spec):
        return spec
    if not isinstance(spec, str) or "." not in spec:
        raise ValueError(
            f"A reward function must be a callable or an import path such as 'my_rewards.accuracy', got {spec!r}."
        )
    module_name, _, name = spec.rpartition(".")
    try:
        found = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"Cannot import the reward function {spec!r}: {error}.") from error
    if not callable(found):
        raise ValueError(f"The reward function {spec!r} is a {type(found).__name__}, not a callable.")
    return found


def _name(function: Callable[..., Any]) -> str:
    """What the function's rewards are logged under: its ``__name__``, a callable object's ``name`` (as
    :class:`~lit_memtrain.objectives.reward_model_function.RewardModelFunction` has), else its class's name."""
    name = getattr(function, "__name__", None) or getattr(function, "name", None)
    return name if isinstance(name, str) and name else type(function).__name__


def _as_reward(value: Any) -> float | None:
    """A reward as a float (None: not scored), or a TypeError / ValueError saying what it is instead."""
    if value is None:
        return None
    if isinstance(value, Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"a {type(value).__name__} ({value!r:.60}) where a number or None was expected")
    value = float(value)
    if math.isinf(value):
        raise ValueError(f"{value} (rewards must be finite; return None for a completion that cannot be scored)")
    return None if math.isnan(value) else value


class RewardFunctions:
    """The run's reward functions and their weights, called once per generation batch.

    Args:
        functions: callables with TRL's signature, or import paths to them.
        weights: one weight per function (TRL's ``reward_weights``); all 1.0 when None.

    Example:
        >>> def length(prompts, completions, **kwargs):
        ...     return [float(len(c)) for c in completions]
        >>> rewards = RewardFunctions([length], weights=[0.5])
        >>> rewards(["1 + 1 ="], ["2"], [[17]], {}, where="a test batch")
        tensor([[1.]])
    """

    def __init__(
        self, functions: Sequence[str | Callable[..., Any]], weights: Sequence[float] | None = None
    ) -> None:
        if isinstance(functions, (str, bytes)) or callable(functions):
            functions = [functions]
        if not functions:
            raise ValueError("At least one reward function is needed (reward_funcs), in TRL's signature.")
        self.functions = [resolve_reward_function(spec) for spec in functions]
        self.names = [_name(function) for function in self.functions]
        if weights is None:
            weights = [1.0] * len(self.functions)
        if len(weights) != len(self.functions):
            raise ValueError(
                f"reward_weights has {len(weights)} values for {len(self.functions)} reward functions {self.names}."
            )
        if not all(isinstance(w, numbers.Real) and math.isfinite(w) for w in weights):
            raise ValueError(f"reward_weights must be finite numbers, got {list(weights)}.")
        self.weights = torch.tensor([float(w) for w in weights], dtype=torch.float32)

    def __len__(self) -> int:
        return len(self.functions)

    def __call__(
        self,
        prompts: Sequence[Any],
        completions: Sequence[Any],
        completion_ids: Sequence[Sequence[int]],
        columns: Mapping[str, Sequence[Any]],
        where: str,
        **extra: Any,
    ) -> Tensor:
        """``[N, K]`` float32 rewards of the ``N`` completions by the ``K`` functions, NaN where not scored.

        ``columns`` are the other dataset columns (one value per completion), ``extra`` further keyword arguments
        (``trainer_state``, ``log_metric``, ``log_extra``); ``where`` names the batch in errors ("training batch 12,
        step 40").

        Raises:
            RuntimeError: a function raised (chained).
            ValueError: a function returned another number of rewards, a non-number or an infinite value.
        """
        count = len(completions)
        rewards = torch.empty(count, len(self.functions), dtype=torch.float32)
        for index, (function, name) in enumerate(zip(self.functions, self.names)):
            try:
                values = function(
                    prompts=list(prompts), completions=list(completions), completion_ids=list(completion_ids),
                    **columns, **extra,
                )  # fmt: skip
            except Exception as error:  # noqa: BLE001 - re-raised with the function and the batch named
                raise RuntimeError(
                    f"The reward function {name!r} raised {type(error).__name__} on {where}: {error}"
                ) from error
            rewards[:, index] = self._check(values, count, name, where)
        return rewards

    @staticmethod
    def _check(values: Any, count: int, name: str, where: str) -> Tensor:
        returned = type(values).__name__
        if hasattr(values, "tolist"):  # a tensor or a NumPy array
            values = values.tolist()
        if isinstance(values, (str, bytes, Mapping)) or not hasattr(values, "__iter__"):
            raise ValueError(
                f"The reward function {name!r} returned a {returned} on {where}; it must return a list of {count} "
                "rewards (numbers, or None for a completion it cannot score)."
            )
        values = list(values)
        if len(values) != count:
            raise ValueError(
                f"The reward function {name!r} returned {len(values)} rewards on {where}, but {count} were expected "
                "(one per completion)."
            )
        checked = []
        for position, value in enumerate(values):
            try:
                reward = _as_reward(value)
            except (TypeError, ValueError) as error:
                raise ValueError(
                    f"The reward function {name!r} returned {error} for completion {position} of {where}."
                ) from None
            checked.append(float("nan") if reward is None else reward)
        return torch.tensor(checked, dtype=torch.float32)
