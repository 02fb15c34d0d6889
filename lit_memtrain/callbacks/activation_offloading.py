"""Lightning callback offloading the activations saved inside decoder layers to host memory.

Why this span of hooks: the offloading context must be active while forward saves tensors and must keep its
state until backward has used them. Lightning calls ``on_train_batch_start`` before ``training_step`` and
``on_train_batch_end`` after the backward (and, without accumulation, after the optimizer step). With
automatic optimisation ``training_step`` and ``backward`` run inside the optimizer closure, between these
two hooks; with manual optimisation every ``manual_backward`` of the step does too. Hooks such as
``on_after_backward`` would end the context after the first backward of a manual step.

Everything else (which tensors, streams, per-step reset, host RAM warning) lives in
:class:`lit_memtrain.techniques.offload.ActivationOffloader`, usable without Lightning.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lit_memtrain.callbacks.technique_description import CompareRow, TechniqueDescription
from lit_memtrain.techniques.offload import ActivationOffloader

__all__ = ["ActivationOffloading"]


class ActivationOffloading(Callback):
    """Move tensors saved for backward inside decoder layers to pinned host memory during each training step.

    Combine with gradient checkpointing to keep only each layer's input on the host (the usual long-context
    setting), or use alone to offload every activation of the layers. The LM head and loss are not offloaded.

    Args:
        min_offload_bytes: tensors smaller than this stay on the device.
        max_fwd_stash_size: how many of the most recently saved tensors stay on the device as well (backward
            needs them first).
        use_streams: overlap copies with compute on a side CUDA stream.
        layers_path: dotted path to the decoder layer list when it cannot be found automatically
            (for example ``"model.model.layers"``).
        offload_cpu_tensors_for_testing: offload CPU tensors too, so tests run the whole path on CPU.

    Example:
        >>> from lit_memtrain.callbacks.activation_offloading import ActivationOffloading
        >>> trainer = Trainer(callbacks=[ActivationOffloading(max_fwd_stash_size=2)])  # doctest: +SKIP
    """

    def __init__(
        self,
        min_offload_bytes: int = 1024,
        max_fwd_stash_size: int = 5,
        use_streams: bool = True,
        layers_path: str | None = None,
        offload_cpu_tensors_for_testing: bool = False,
    ) -> None:
        if isinstance(min_offload_bytes, bool) or not isinstance(min_offload_bytes, int) or min_offload_bytes < 0:
            raise ValueError(f"min_offload_bytes must be an int >= 0, got {min_offload_bytes!r}.")
        if isinstance(max_fwd_stash_size, bool) or not isinstance(max_fwd_stash_size, int) or max_fwd_stash_size < 0:
            raise ValueError(f"max_fwd_stash_size must be an int >= 0, got {max_fwd_stash_size!r}.")
        self.min_offload_bytes = min_offload_bytes
        self.max_fwd_stash_size = max_fwd_stash_size
        self.use_streams = use_streams
        self.layers_path = layers_path
        self.offload_cpu_tensors_for_testing = offload_cpu_tensors_for_testing
        self.offloader: ActivationOffloader | None = None

    def describe_for_planner(self) -> TechniqueDescription:
        """Activation offloading for ``lit-memtrain plan``: compared in place of offloaded checkpoints (under
        checkpointing both move each layer's input to the host, by two mechanisms; on top of offloaded checkpoints
        it would find nothing left to move); not suggested."""
        return TechniqueDescription(
            "activation offloading",
            order=50,
            rows=(
                CompareRow(
                    "+ activation offloading",
                    50,
                    note="in place of offloaded checkpoints",
                    in_place_of="+ offloaded checkpoints",
                ),
            ),
        )

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.offloader = ActivationOffloader(
            pl_module,
            layers_path=self.layers_path,
            min_offload_bytes=self.min_offload_bytes,
            max_fwd_stash_size=self.max_fwd_stash_size,
            use_streams=self.use_streams,
            offload_cpu_tensors_for_testing=self.offload_cpu_tensors_for_testing,
        )
        if pl_module.device.type == "cpu" and not self.offload_cpu_tensors_for_testing:
            rank_zero_warn(
                "ActivationOffloading does nothing when training on the CPU: activations already live there."
            )
        else:
            rank_zero_info(
                f"ActivationOffloading: tensors of {self.min_offload_bytes:,} bytes or more saved inside "
                f"{len(self.offloader.layers)} decoder layers copied to host memory (the {self.max_fwd_stash_size} "
                "most recent also kept on the device)"
            )

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._stop()
        self.offloader.__enter__()

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._stop()

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._stop()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._stop()

    def _stop(self) -> None:
        if self.offloader is not None:
            self.offloader.__exit__(None, None, None)
