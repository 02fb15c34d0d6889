"""The parallel sizes of a run, their checks and its device mesh, in one object.

Why one object: :class:`~lit_memtrain.strategies.FSDP2Strategy`, ``ContextParallelStrategy`` and the planner's
simulated rank must agree on how the ranks are organised (which sizes are allowed, which mesh dimension is which,
which mesh FSDP2 shards over), or a plan describes another run than the one trained. Each of them builds a
:class:`ParallelDims` and asks it.

How the ranks are organised: ``world size = data_parallel x context_parallel``. The mesh names its dimensions
``("data_parallel", "context_parallel")``, context parallel innermost, so that a context-parallel group is
neighbouring ranks (one node: its exchanges stay on the fastest links); the ``context_parallel`` dimension exists
only when sequences are split (a size above 1), so that ``context_parallel_size=1`` is plain data parallelism.
Lightning's sampler splits rows over ``data_parallel`` only, so every rank of a group loads the same rows. FSDP2
shards over every rank (the dimensions flattened into one), so that each holds ``1 / world`` of the model and
gradients are reduced over all of them, as torchtitan and accelerate do.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = ["ParallelDims"]


def _is_positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass(frozen=True)
class ParallelDims:
    """How ``world_size`` ranks split the work: sequences over context-parallel groups, rows over data parallel.

    Made with sizes that do not fit together it raises ``ValueError``, naming the sizes that would; once made,
    ``data_parallel_size`` is an int (``"auto"`` resolved to ``world_size / context_parallel_size``).

    Args:
        world_size: every rank of the run (devices x nodes).
        context_parallel_size: ranks that share one sequence; must divide ``world_size``.
        data_parallel_size: ranks that train on different rows; ``"auto"`` is ``world_size /
            context_parallel_size``, and any other value must be that.
        world_size_source: how ``world_size`` was counted (``"2 node(s) x 4 device(s)"``), named in errors.

    Example:
        >>> dims = ParallelDims(8, context_parallel_size=4)
        >>> dims.mesh_shape, dims.data_parallel_size
        ({'data_parallel': 2, 'context_parallel': 4}, 2)
        >>> ParallelDims(8).mesh_shape
        {'data_parallel': 8}
    """

    world_size: int
    context_parallel_size: int = 1
    data_parallel_size: int | Literal["auto"] = "auto"
    world_size_source: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        world = self.world_size
        origin = f" ({self.world_size_source})" if self.world_size_source else ""
        if not _is_positive_int(world):
            raise ValueError(f"The world size{origin} must be a positive int, got {world!r}.")
        self.check_sizes(self.context_parallel_size, self.data_parallel_size)
        cp = self.context_parallel_size
        if world % cp:
            divisors = [d for d in range(1, world + 1) if world % d == 0]
            raise ValueError(
                f"context_parallel_size={cp} does not divide the world size {world}{origin}: the ranks form groups of "
                f"{cp} that share a sequence. Use one of {divisors}, or more devices."
            )
        expected = world // cp
        found = self.data_parallel_size
        if found not in ("auto", expected):
            if cp == 1:
                reason = f"does not match the world size {world}{origin}: every rank shards the model"
            else:
                reason = (
                    f"with context_parallel_size={cp} does not fill the world size {world}{origin}: the ranks form "
                    f"groups of {cp} that share a sequence"
                )
            raise ValueError(
                f"The data-parallel size (data_parallel_size={found}) {reason}, so the data-parallel size must be "
                f"{expected}. Leave it at 'auto'."
            )
        object.__setattr__(self, "data_parallel_size", expected)

    @staticmethod
    def check_sizes(context_parallel_size: int = 1, data_parallel_size: int | Literal["auto"] = "auto") -> None:
        """Raise ``ValueError`` unless the sizes are positive ints (``data_parallel_size`` may be ``"auto"``).

        What can be checked before the world size is known: a strategy calls it in its constructor, so that a
        config with a bad size fails when it is read.
        """
        if not _is_positive_int(context_parallel_size):
            raise ValueError(f"context_parallel_size must be a positive int, got {context_parallel_size!r}.")
        if data_parallel_size != "auto" and not _is_positive_int(data_parallel_size):
            raise ValueError(f"data_parallel_size must be a positive int or 'auto', got {data_parallel_size!r}.")

    @property
    def mesh_shape(self) -> dict[str, int]:
        """The size of each mesh dimension, outermost first: ``data_parallel``, then ``context_parallel`` when
        sequences are split."""
        shape = {"data_parallel": int(self.data_parallel_size)}
        if self.context_parallel_size > 1:
            shape["context_parallel"] = self.context_parallel_size
        return shape

    def build_meshes(self, device_type: str) -> tuple[DeviceMesh, DeviceMesh]:
        """The device mesh of :attr:`mesh_shape` and the 1-D mesh FSDP2 shards over (every rank: the mesh itself,
        or its dimensions flattened into one).

        Needs the default process group of ``world_size`` ranks; call it outside ``FakeTensorMode`` (a mesh reads
        the values of its rank tensor).
        """
        shape = self.mesh_shape
        mesh = init_device_mesh(device_type, tuple(shape.values()), mesh_dim_names=tuple(shape))
        return mesh, mesh if mesh.ndim == 1 else mesh._flatten("dp_cp")
