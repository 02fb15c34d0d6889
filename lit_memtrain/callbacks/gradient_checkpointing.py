"""Lightning callback checkpointing every decoder layer: full, selective or with offloaded inputs.

Why a callback: checkpointing is a property of the training run, not of the model, and must work on a
user's own LightningModule holding a Hugging Face causal LM as well as on ours. The layers are found when
the fit starts, after ``configure_model`` (where sharded or LoRA models are often built) and after the
strategy has placed the model; the original forwards and ``config.use_cache`` are restored when the fit
ends, so exporting or generating afterwards sees the plain model.

What each mode keeps, and the transforms themselves: :mod:`lit_memtrain.techniques.checkpointing`.
"""

from __future__ import annotations

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info
from transformers import PretrainedConfig

from lit_memtrain.callbacks.activation_offloading import ActivationOffloading
from lit_memtrain.callbacks.restored_at_fit_end import RestoredAtFitEnd
from lit_memtrain.callbacks.technique_description import CompareRow, Suggestion, TechniqueDescription
from lit_memtrain.models.layers import find_decoder_layers, validate_layers_path
from lit_memtrain.techniques.checkpointing import apply_checkpointing

__all__ = ["GradientCheckpointing"]


class GradientCheckpointing(RestoredAtFitEnd):
    """Non-reentrant activation checkpointing of each decoder layer during ``fit``.

    Args:
        selective: also keep the attention kernels' outputs, so backward does not recompute attention
            (one extra ``L x heads x head_dim`` tensor plus an fp32 log-sum-exp per layer).
        offload: keep each layer's checkpointed input in host memory (pinned on CUDA) until its backward.
        layers_path: dotted path to the decoder layer list from the LightningModule when it cannot be
            found automatically (for example ``"model.model.layers"``).

    Example:
        >>> from lit_memtrain.callbacks.gradient_checkpointing import GradientCheckpointing
        >>> trainer = Trainer(callbacks=[GradientCheckpointing(selective=True)])  # doctest: +SKIP
    """

    def __init__(self, selective: bool = False, offload: bool = False, layers_path: str | None = None) -> None:
        for name, value in (("selective", selective), ("offload", offload)):
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be True or False, got {value!r}.")
        validate_layers_path(layers_path)
        self.selective = selective
        self.offload = offload
        self.layers_path = layers_path
        self._caching_configs: list[PretrainedConfig] = []

    def describe_for_planner(self) -> TechniqueDescription:
        """Checkpointing for ``lit-memtrain plan``: full, then offloaded, checkpoints in ``--compare``; suggested
        first, offloaded next, and full instead of selective last (selective keeps more on the device)."""
        words = {
            (False, False): "gradient checkpointing",
            (True, False): "selective checkpointing",
            (False, True): "checkpointing with offloaded inputs",
            (True, True): "selective checkpointing with offloaded inputs",
        }[(self.selective, self.offload)]
        return TechniqueDescription(
            words,
            order=10,
            rows=(
                CompareRow("+ checkpointing", 10, {"selective": False, "offload": False}),
                CompareRow("+ offloaded checkpoints", 40, {"offload": True}),
            ),
            suggestions=(
                Suggestion("gradient checkpointing (callback lit_memtrain.callbacks.GradientCheckpointing)", 10),
                # Activation offloading already moves what offloaded checkpoints would (each layer's input).
                Suggestion(
                    "offloaded checkpoints (GradientCheckpointing with init_args offload: true)",
                    40,
                    {"offload": True},
                    unless=(ActivationOffloading,),
                ),
                Suggestion(
                    "full instead of selective checkpointing (GradientCheckpointing with init_args selective: false)",
                    60,
                    {"selective": False},
                ),
            ),
        )

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        try:
            layers = find_decoder_layers(pl_module, self.layers_path)
        except ValueError as error:
            raise ValueError(f"GradientCheckpointing has no layers to checkpoint: {error}") from error
        self._restore = apply_checkpointing(layers, selective=self.selective, offload=self.offload)
        inputs = ", inputs offloaded to host memory" if self.offload else ""
        rank_zero_info(
            f"GradientCheckpointing: {len(layers)} decoder layers checkpointed "
            f"({'selective' if self.selective else 'full'}{inputs})"
        )
        # A KV cache built in a training forward is updated again when a layer is recomputed.
        configs = {
            id(module.config): module.config
            for module in pl_module.modules()
            if isinstance(getattr(module, "config", None), PretrainedConfig)
        }
        self._caching_configs = [config for config in configs.values() if getattr(config, "use_cache", False)]
        for config in self._caching_configs:
            config.use_cache = False

    def _undo(self) -> None:
        super()._undo()
        for config in self._caching_configs:
            config.use_cache = True
        self._caching_configs = []
