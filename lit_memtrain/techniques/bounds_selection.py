"""BoundsSelection: which of a chunked technique's ``[start, end)`` pieces run, for simulating memory.

Why: the chunked loss, tiled MLP and chunked RMSNorm run the same computation piece after piece; on fake tensors
the planner needs only the first few and the last to know the peak of all (each piece frees what the one before
allocated). Each technique offers a public context (``selected_loss_chunks``, ``selected_tiles``,
``selected_chunks``) over one of these; while it is open, the technique's pieces are the ones ``select`` keeps.
On real tensors the pieces left out are missing from the result: never train inside such a context.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

__all__ = ["Bounds", "BoundsSelection"]

Bounds = list[tuple[int, int]]


class BoundsSelection:
    """The selection in force for one technique: all pieces, or those a ``select`` function keeps.

    Example:
        >>> pieces = BoundsSelection()
        >>> with pieces.only(lambda bounds: bounds[:1]):
        ...     pieces([(0, 4), (4, 8)])
        [(0, 4)]
    """

    def __init__(self) -> None:
        self._select: Callable[[Bounds], Bounds] | None = None

    @contextlib.contextmanager
    def only(self, select: Callable[[Bounds], Bounds]) -> Iterator[None]:
        """Keep the pieces ``select`` returns while the context is open (contexts nest)."""
        previous, self._select = self._select, select
        try:
            yield
        finally:
            self._select = previous

    def __call__(self, bounds: Bounds) -> Bounds:
        return bounds if self._select is None else self._select(bounds)
