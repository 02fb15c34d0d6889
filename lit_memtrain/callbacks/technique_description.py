"""What a technique callback tells the memory planner about itself: the protocol and its description.

Why the callbacks describe themselves: ``lit-memtrain plan`` simulates the callbacks of a configuration, names
them in its ``Techniques:`` line, replays the configuration with techniques added one at a time (``--compare``)
and says which to add when a plan does not fit. Each of those needs a few facts about each technique; kept by the
technique's own callback, they are in one place, and a new technique is planned, compared and suggested once its
callback (with :meth:`PlannedTechnique.describe_for_planner`) is exported from :mod:`lit_memtrain.callbacks`, or
configured in ``trainer.callbacks`` (a user's own). The planner finds them there (docs/planner.md).

The planner keeps its own techniques, those that are not callbacks, at these places (``order``): in the
``Techniques:`` line and among ``--compare``'s rows the chunked loss at 20, CPU-offloaded state at 60 and context
parallelism at 70 (the ``plain`` row at 0); among the suggestions the chunked loss at 20 and CPU-offloaded state
at 70.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

__all__ = ["CompareRow", "PlannedTechnique", "Suggestion", "TechniqueDescription"]


@dataclass(frozen=True)
class CompareRow:
    """A row of ``lit-memtrain plan --compare``: the technique added to the last row above it that was simulated.

    Attributes:
        name: the row's name, ``"+ tiled MLP"``.
        order: where the row goes, lowest first, among every technique's rows and the planner's own.
        init_args: the callback's arguments in this row, over those it already has there (from a row above), or
            else those the configuration gives it.
        note: printed after the row's name.
        in_place_of: the name of a row this one is an alternative to: it adds to what that row added to, and the
            planner's own rows (CPU-offloaded state, context parallelism) skip it and build on that row.
    """

    name: str
    order: int
    init_args: dict[str, Any] = field(default_factory=dict)
    note: str = ""
    in_place_of: str | None = None


@dataclass(frozen=True)
class Suggestion:
    """A technique the planner tries, in turn with the others, for a plan that does not fit.

    Attributes:
        text: what to add and how, as the plan says it (``"tiled MLPs (callback lit_memtrain.callbacks.TiledMLP)"``).
        order: when it is tried, lowest first, among every technique's suggestions and the planner's own.
        init_args: the callback's arguments set, over those it already has; the callback is added when missing.
        unless: callback classes whose presence makes this suggestion pointless (it is then not made).
    """

    text: str
    order: int
    init_args: dict[str, Any] = field(default_factory=dict)
    unless: tuple[type, ...] = ()


@dataclass(frozen=True)
class TechniqueDescription:
    """A configured technique callback as the planner shows and varies it.

    Attributes:
        words: what this instance does, in the plan's ``Techniques:`` line (``"selective checkpointing"``).
        order: where it is named in that line, lowest first, among the others and the planner's own.
        rows: its rows of ``--compare``.
        suggestions: what it offers a plan that does not fit.
    """

    words: str
    order: int
    rows: tuple[CompareRow, ...] = ()
    suggestions: tuple[Suggestion, ...] = ()


@runtime_checkable
class PlannedTechnique(Protocol):
    """A callback that changes a training step's memory, and that the planner simulates (through its own hooks:
    ``on_fit_start``, ``on_train_batch_start``/``end``, ``teardown``) and describes.

    The planner builds the callback from the configuration's ``init_args``, and with its defaults to offer its rows
    and suggestions to a configuration that lacks it: a technique callback can be built without arguments.
    """

    def describe_for_planner(self) -> TechniqueDescription:
        """This instance's description (see :class:`TechniqueDescription`)."""
        ...
