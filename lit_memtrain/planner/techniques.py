"""Switching a configuration's memory techniques on and off, for the comparison and the suggestions.

Why a small description of its own: ``--compare`` replays the same model, precision and batch with the
techniques added one at a time, and a plan that does not fit says which technique to add. Both edit the
same things of :class:`~lit_memtrain.planner.settings.PlanSettings`: the loss, the checkpointing
callback's mode, the tiled-MLP, activation-offloading and chunked-RMSNorm callbacks, and for the sharded
strategies (FSDP2, context parallel) ``cpu_offload`` and the context-parallel size. Options the user gave those
callbacks (``layers_path``, ``num_tiles``, offloading thresholds) are kept when a technique stays on.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from lit_memtrain.callbacks.activation_offloading import ActivationOffloading
from lit_memtrain.callbacks.chunked_rms_norm import ChunkedRMSNorm
from lit_memtrain.callbacks.gradient_checkpointing import GradientCheckpointing
from lit_memtrain.callbacks.tiled_mlp import TiledMLP
from lit_memtrain.planner.settings import CallbackSpec, PlanSettings

__all__ = ["SUGGESTIONS", "Techniques", "comparison_rows", "techniques_of", "with_techniques"]

Checkpointing = Literal["full", "selective", "offload", "selective_offload"]


@dataclass(frozen=True)
class Techniques:
    """The memory techniques of a configuration."""

    checkpointing: Checkpointing | None = None
    chunked_loss: bool = False
    tiled_mlp: bool = False
    activation_offloading: bool = False
    cpu_offload: bool = False
    context_parallel_size: int = 1
    chunked_rms_norm: bool = False

    def describe(self) -> str:
        parts = []
        if self.checkpointing is not None:
            parts.append({
                "full": "gradient checkpointing",
                "selective": "selective checkpointing",
                "offload": "checkpointing with offloaded inputs",
                "selective_offload": "selective checkpointing with offloaded inputs",
            }[self.checkpointing])
        parts += [name for name, on in (
            ("chunked loss", self.chunked_loss),
            ("tiled MLP", self.tiled_mlp),
            ("activation offloading", self.activation_offloading),
            ("CPU-offloaded state", self.cpu_offload),
            (f"context parallel over {self.context_parallel_size} ranks", self.context_parallel_size > 1),
            ("chunked RMSNorm", self.chunked_rms_norm),
        ) if on]  # fmt: skip
        return ", ".join(parts) or "none"


def techniques_of(settings: PlanSettings) -> Techniques:
    """The techniques ``settings`` turn on."""
    checkpointing = None
    spec = settings.callback(GradientCheckpointing)
    if spec is not None:
        selective, offload = spec.init_args.get("selective", False), spec.init_args.get("offload", False)
        checkpointing = {(False, False): "full", (True, False): "selective", (False, True): "offload"}.get(
            (selective, offload), "selective_offload"
        )
    return Techniques(
        checkpointing=checkpointing,
        chunked_loss=settings.module.get("loss_type", "chunked") == "chunked",
        tiled_mlp=settings.callback(TiledMLP) is not None,
        activation_offloading=settings.callback(ActivationOffloading) is not None,
        cpu_offload=settings.strategy.cpu_offload,
        context_parallel_size=settings.strategy.context_parallel_size,
        chunked_rms_norm=settings.callback(ChunkedRMSNorm) is not None,
    )


def _spec(settings: PlanSettings, kind: type, **init_args: object) -> CallbackSpec:
    existing = settings.callback(kind)
    kept = dict(existing.init_args) if existing is not None else {}
    return CallbackSpec(f"{kind.__module__}.{kind.__qualname__}", {**kept, **init_args})


def with_techniques(settings: PlanSettings, techniques: Techniques) -> PlanSettings:
    """``settings`` with exactly ``techniques`` on (everything else unchanged)."""
    callbacks = list(settings.without_callbacks(GradientCheckpointing, TiledMLP, ActivationOffloading, ChunkedRMSNorm))
    if techniques.checkpointing is not None:
        selective = techniques.checkpointing.startswith("selective")
        offload = techniques.checkpointing.endswith("offload")
        callbacks.append(_spec(settings, GradientCheckpointing, selective=selective, offload=offload))
    if techniques.tiled_mlp:
        callbacks.append(_spec(settings, TiledMLP))
    if techniques.activation_offloading:
        callbacks.append(_spec(settings, ActivationOffloading))
    if techniques.chunked_rms_norm:
        callbacks.append(_spec(settings, ChunkedRMSNorm))
    module = {**settings.module, "loss_type": "chunked" if techniques.chunked_loss else "nll"}
    strategy = dataclasses.replace(
        settings.strategy, cpu_offload=techniques.cpu_offload, context_parallel_size=techniques.context_parallel_size
    )
    return settings.replace(module=module, callbacks=tuple(callbacks), strategy=strategy)


# One row per technique added in turn. Activation offloading moves the same tensors as offloaded
# checkpoints (each layer's input, under checkpointing) by another mechanism, so its row replaces that one
# instead of adding to it (on top of offloaded checkpoints it would find nothing left to move); the rows after
# it build on offloaded checkpoints.
_FULL = Techniques(checkpointing="full", chunked_loss=True, tiled_mlp=True)
_OFFLOADED = Techniques(checkpointing="offload", chunked_loss=True, tiled_mlp=True)


def comparison_rows(settings: PlanSettings) -> list[tuple[str, Techniques | None, str]]:
    """``--compare``'s rows for ``settings``: (name, techniques or None when the strategy cannot have it, note).

    The strategy's own rows: CPU-offloaded state for a sharded strategy (FSDP2 or context parallel), context
    parallelism when the configuration splits sequences (``context_parallel_size > 1``). The rows before them
    run the same strategy without them. The last row adds chunked RMSNorms to the last row simulated.
    """
    strategy = settings.strategy
    offloaded_state = dataclasses.replace(_OFFLOADED, cpu_offload=True)
    cp = strategy.context_parallel_size
    rows = [
        ("plain", Techniques(), ""),
        ("+ checkpointing", Techniques(checkpointing="full"), ""),
        ("+ chunked loss", Techniques(checkpointing="full", chunked_loss=True), ""),
        ("+ tiled MLP", _FULL, ""),
        ("+ offloaded checkpoints", _OFFLOADED, ""),
        ("+ activation offloading", dataclasses.replace(_FULL, activation_offloading=True),
         "in place of offloaded checkpoints"),
        ("+ CPU-offloaded state", offloaded_state, "") if strategy.sharded else
        ("+ CPU-offloaded state", None,
         "needs --trainer.strategy=lit_memtrain.strategies.FSDP2Strategy (cpu_offload: true)"),
        ("+ context parallel", dataclasses.replace(offloaded_state, context_parallel_size=cp),
         f"{cp} ranks per sequence, {strategy.context_parallel_method}") if cp > 1 else
        ("+ context parallel", None, "DPOModule does not support context parallelism") if settings.preference else
        ("+ context parallel", None,
         "needs lit_memtrain.strategies.ContextParallelStrategy or --context-parallel-size"),
    ]  # fmt: skip
    last = next(techniques for _, techniques, _ in reversed(rows) if techniques is not None)
    return [*rows, ("+ chunked RMSNorm", dataclasses.replace(last, chunked_rms_norm=True), "")]


# What a plan that does not fit tries, in this order, each on top of the previous ones: (name, how to add it).
SUGGESTIONS: list[tuple[str, str]] = [
    ("checkpointing", "gradient checkpointing (callback lit_memtrain.callbacks.GradientCheckpointing)"),
    ("chunked_loss", "the chunked loss (model.loss_type: chunked)"),
    ("tiled_mlp", "tiled MLPs (callback lit_memtrain.callbacks.TiledMLP)"),
    ("offload", "offloaded checkpoints (GradientCheckpointing with init_args offload: true)"),
    ("chunked_rms_norm", "chunked RMSNorm (callback lit_memtrain.callbacks.ChunkedRMSNorm)"),
    ("full_checkpointing",
     "full instead of selective checkpointing (GradientCheckpointing with init_args selective: false)"),
    ("cpu_offload", "CPU-offloaded state (FSDP2Strategy with init_args cpu_offload: true)"),
]
