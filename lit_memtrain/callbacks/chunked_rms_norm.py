"""Lightning callback running the model's RMSNorms in fp32 chunks of tokens (:mod:`lit_memtrain.techniques.rms_norm`).

Why a callback: like tiled MLPs, it is a property of the run and must work on a user's own LightningModule
holding a Hugging Face causal LM. The norms are found and probed when the fit starts (after
``configure_model`` and the strategy's sharding) and restored when it ends. Composes with
:class:`GradientCheckpointing`, :class:`TiledMLP`, the chunked loss and context parallelism in any order.
"""

from __future__ import annotations

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.distributed.fsdp import FSDPModule

from lit_memtrain.callbacks.restored_at_fit_end import RestoredAtFitEnd
from lit_memtrain.callbacks.technique_description import CompareRow, Suggestion, TechniqueDescription
from lit_memtrain.techniques.rms_norm import (
    DEFAULT_CHUNK_ELEMENTS,
    apply_chunked_rms_norm,
    run_dtypes,
    validate_chunk_elements,
)

__all__ = ["ChunkedRMSNorm"]


class ChunkedRMSNorm(RestoredAtFitEnd):
    """Memory-efficient RMSNorms during ``fit``: fp32 over chunks of tokens, saving the input and ``rstd`` only.

    Every module whose class is named ``*RMSNorm`` and whose output a probe at fit start shows equal to the
    chunked computation, in the precisions this fit computes in (:meth:`run_dtypes`), is replaced; classes the probe rejects keep their own forward (named in a warning), and
    a model with no replaceable norm is an error.

    Args:
        chunk_elements: elements per fp32 chunk (tokens per chunk = ``chunk_elements // hidden size``).

    Example:
        >>> from lit_memtrain.callbacks import ChunkedRMSNorm, GradientCheckpointing, TiledMLP
        >>> trainer = Trainer(callbacks=[GradientCheckpointing(), TiledMLP(), ChunkedRMSNorm()])  # doctest: +SKIP
    """

    def __init__(self, chunk_elements: int = DEFAULT_CHUNK_ELEMENTS) -> None:
        validate_chunk_elements(chunk_elements)
        self.chunk_elements = chunk_elements

    def describe_for_planner(self) -> TechniqueDescription:
        """Chunked RMSNorms for ``lit-memtrain plan``: the last row of ``--compare``, on the row above it; suggested
        after offloaded checkpoints. A model whose norms the probe rejects (Gemma's) refuses it: its row then says
        why, and it is not suggested."""
        return TechniqueDescription(
            "chunked RMSNorm",
            order=80,
            rows=(CompareRow("+ chunked RMSNorm", 80),),
            suggestions=(Suggestion("chunked RMSNorm (callback lit_memtrain.callbacks.ChunkedRMSNorm)", 50),),
        )

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        norms = [type(module).__name__ for module in pl_module.modules() if type(module).__name__.endswith("RMSNorm")]
        found = set(norms)
        if not found:
            raise ValueError(
                "ChunkedRMSNorm found no RMSNorm module (a class named '*RMSNorm') in the model; leave it out."
            )
        dtypes = self.run_dtypes(trainer, pl_module)
        self._restore, skipped = apply_chunked_rms_norm(pl_module.modules(), self.chunk_elements, dtypes)
        reasons = "; ".join(f"{name}: {reason}" for name, reason in skipped.items())
        if len(skipped) == len(found):
            self._undo()
            raise ValueError(
                f"ChunkedRMSNorm cannot prove any of the model's norms equal to its chunked computation ({reasons}). "
                "Leave ChunkedRMSNorm out for this model."
            )
        if skipped:
            rank_zero_warn(f"ChunkedRMSNorm leaves these norms as they are ({reasons}).")
        replaced = [name for name in norms if name not in skipped]
        rank_zero_info(
            f"ChunkedRMSNorm: {len(replaced)} norms ({', '.join(sorted(set(replaced)))}) replaced by fp32 chunks of "
            f"{self.chunk_elements:,} elements"
        )

    @staticmethod
    def run_dtypes(trainer: Trainer, pl_module: LightningModule) -> frozenset[torch.dtype] | None:
        """The dtypes this fit computes in besides fp32 and the weights' own, for the probe
        (:func:`~lit_memtrain.techniques.rms_norm.run_dtypes`): the Trainer's precision (``trainer.precision``, its
        precision plugin's name: autocast's dtype under ``bf16-mixed`` / ``16-mixed``; ``-true`` precisions have
        converted the weights before fit start, which the probe reads from each norm) and the dtype a strategy with
        an FSDP2 ``mp_policy`` gathers the parameters in. ``None`` (every precision) for a precision plugin not known
        there, or a model sharded by FSDP2 under a policy the strategy does not expose (a user's ``fully_shard``).

        Why not every precision always: a norm that applies its weight in fp32 (OLMo 2's) differs from the chunked
        one on half-precision inputs only; refusing it for a pure fp32 fit, where it is exact, took the memory saving
        away for nothing.
        """
        if not hasattr(trainer.strategy, "mp_policy") and any(isinstance(m, FSDPModule) for m in pl_module.modules()):
            return None
        policy = trainer.strategy.mp_policy if hasattr(trainer.strategy, "mp_policy") else None
        return run_dtypes(str(trainer.precision), getattr(policy, "param_dtype", None))
