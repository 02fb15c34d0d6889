"""Lightning callback running each decoder layer's MLP over the sequence in tiles.

Why a callback: like checkpointing, tiling is a property of the run, and must work on a user's own
LightningModule holding a Hugging Face causal LM. The MLPs are found when the fit starts (after
``configure_model``) and restored when it ends. Composes with :class:`GradientCheckpointing` and the
chunked loss in any order.

Why and how tiles save memory, the tile count rule, and mixture-of-experts layers (their experts are tiled,
the router runs whole): :mod:`lit_memtrain.techniques.tiled_mlp`.
"""

from __future__ import annotations

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info

from lit_memtrain.callbacks.restored_at_fit_end import RestoredAtFitEnd
from lit_memtrain.callbacks.technique_description import CompareRow, Suggestion, TechniqueDescription
from lit_memtrain.models.layers import find_decoder_layers, validate_layers_path
from lit_memtrain.techniques.tiled_mlp import apply_tiled_mlp, validate_num_tiles

__all__ = ["TiledMLP"]


class TiledMLP(RestoredAtFitEnd):
    """Sequence-tiled MLPs in every decoder layer during ``fit`` (ALST's tiled MLP).

    Args:
        num_tiles: tiles per MLP call; ``None`` picks ``ceil(L / max(H, 1024))`` from each call's sequence
            length L and hidden size H (tiles of about H tokens).
        layers_path: dotted path to the decoder layer list from the LightningModule when it cannot be
            found automatically (for example ``"model.model.layers"``).

    Example:
        >>> from lit_memtrain.callbacks.tiled_mlp import TiledMLP
        >>> trainer = Trainer(callbacks=[GradientCheckpointing(), TiledMLP()])  # doctest: +SKIP
    """

    def __init__(self, num_tiles: int | None = None, layers_path: str | None = None) -> None:
        validate_num_tiles(num_tiles)
        validate_layers_path(layers_path)
        self.num_tiles = num_tiles
        self.layers_path = layers_path

    def describe_for_planner(self) -> TechniqueDescription:
        """Tiled MLPs for ``lit-memtrain plan``: compared after the chunked loss, suggested after it."""
        return TechniqueDescription(
            "tiled MLP",
            order=30,
            rows=(CompareRow("+ tiled MLP", 30),),
            suggestions=(Suggestion("tiled MLPs (callback lit_memtrain.callbacks.TiledMLP)", 30),),
        )

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        try:
            layers = find_decoder_layers(pl_module, self.layers_path)
        except ValueError as error:
            raise ValueError(f"TiledMLP has no decoder layers to tile: {error}") from error
        self._restore = apply_tiled_mlp(layers, self.num_tiles)
        tiles = f"{self.num_tiles} tiles per call" if self.num_tiles else "tiles of about max(hidden size, 1024) tokens"
        rank_zero_info(f"TiledMLP: the MLPs of {len(layers)} decoder layers tiled along the sequence ({tiles})")
