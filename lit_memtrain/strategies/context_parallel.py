"""ContextParallelStrategy: FSDP2 plus one sequence split over the ranks of a context-parallel group.

Why a strategy: context parallelism changes four things around an otherwise ordinary FSDP2 step, and all four
belong to how the ranks are organised, not to the model or the loss:

- *The mesh* is ``(data_parallel, context_parallel)`` with context parallel innermost (a group is neighbouring
  ranks, on one node), as :class:`~lit_memtrain.parallel.dims.ParallelDims` builds it for the strategies and the
  planner alike. FSDP shards over the flattened mesh, so every rank holds ``1 / world`` of the model and
  gradients are reduced over every rank. Lightning's sampler splits rows over ``data_parallel`` only: every rank
  of a group loads the same rows.
- *Each batch is sharded along the sequence* as it reaches the device (:meth:`batch_to_device`, with
  :func:`~lit_memtrain.parallel.context_parallel.shard_batch`): targets shifted on the whole row first (``shift_labels``,
  which the module takes as they are), rows padded to what the method needs (logged once, in tokens), global
  position ids (RoPE and YaRN rotate each token as on one process) and the row's document bounds, handed to
  the attention installed on the model. Validation batches are sharded the same way.
- *Attention* is swapped for Ulysses or ring (:func:`~lit_memtrain.parallel.context_parallel.install_attention`) when
  a stage starts (``on_train_start``, ``on_validation_start``, ...: Lightning calls the strategy's hook after the
  module's, so the module's setup probes have run with the model's own attention, and before the first batch),
  and restored when training ends. It is installed only once a probe row split over the group gave what it gives
  whole (:func:`~lit_memtrain.parallel.context_parallel.install_checked_attention`): a model that mixes tokens
  outside its attention (Mamba, linear attention, convolutions, ALiBi) is refused there, before any batch.
  :meth:`batch_to_device` only shards each batch and hands its layout over.
- *The loss* needs nothing new: the module divides each micro-batch's loss by the step's trainable tokens
  counted on the whole rows and summed over ``data_parallel`` (each row once), and each rank's loss is the sum
  over its own tokens, so the ranks' gradients add up to one process's on the whole sequence. Each rank counts
  the real tokens of its shard, and the module sums them over every rank, so ``train/tokens``,
  ``train/tokens_per_sec`` and the end-of-fit summary count each token once (one process's figures).

torch's ring kernels (``method="ring", ring_backend="torch"``, CUDA) replace SDPA only while their context is
open; backward calls them again, so the context is opened in ``on_train_batch_start`` and closed once the
micro-batch's backward has run (and around each validation step).
"""

from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from typing_extensions import override

from lit_memtrain.models.moe import router_aux_coefficient
from lit_memtrain.objectives.throughput import attention_pairs
from lit_memtrain.parallel.context_parallel import (
    INNER_ATTENTIONS,
    METHODS,
    RING_BACKENDS,
    ContextParallelAttention,
    ShardLayout,
    check_context_parallel,
    check_same_rows,
    install_checked_attention,
    shard_batch,
    torch_ring_attention,
)
from lit_memtrain.parallel.dims import ParallelDims
from lit_memtrain.strategies.fsdp2 import FSDP2Strategy
from lit_memtrain.techniques.attention import SDPA_BY_DOCUMENT, check_flash_attn

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.optim import Optimizer

__all__ = ["ContextParallelStrategy"]


class ContextParallelStrategy(FSDP2Strategy):
    """FSDP2 over every rank, and each row's sequence split over ``context_parallel_size`` ranks.

    Args:
        context_parallel_size: ranks that share one row (must divide the world size). 1 is plain
            :class:`~lit_memtrain.strategies.FSDP2Strategy`.
        method: ``"ulysses"`` (all-to-all from sequence to head shards around any kernel: needs
            ``num_attention_heads % cp == 0`` and ``num_key_value_heads % cp == 0`` or ``cp % num_key_value_heads
            == 0``) or ``"ring"`` (each rank's queries against the whole row's keys and values, any head counts).
        inner: Ulysses' kernel over the whole row: ``"sdpa_by_document"`` (any device), ``"flash_attention_2"``
            (CUDA, flash-attn varlen) or ``"sdpa"`` (single-document rows only).
        ring_backend: ``"all_gather"`` (keys and values of the row gathered on each rank, document-aware, any
            device) or ``"torch"`` (torch's ring over the flash / efficient / cuDNN kernels, CUDA, single-document
            rows only: packed rows are refused).
        pad_token_id: input id written into the padding added to reach the length ``method`` needs (never
            attended to by a real token, never trained on).
        data_parallel_size: ``"auto"`` is ``world size / context_parallel_size``.
        **kwargs: the other :class:`~lightning.pytorch.strategies.ModelParallelStrategy` / FSDP2 options
            (``mixed_precision``, ``reshard_after_forward``, ``cpu_offload``, ``save_distributed_checkpoint``,
            ``start_method``, ``process_group_backend``, ``timeout``).

    Rows must carry no padding mask: use padding-free batches (``SFTDataModule(packing=True)``, or any collator
    giving ``input_ids``, ``labels`` and, for packed rows, ``position_ids`` restarting per document).

    Example:
        >>> from lit_memtrain.strategies import ContextParallelStrategy
        >>> strategy = ContextParallelStrategy(context_parallel_size=8, method="ulysses", mixed_precision="bf16")
        >>> trainer = Trainer(accelerator="gpu", devices=8, strategy=strategy)  # doctest: +SKIP

        On the command line: ``--trainer.strategy=lit_memtrain.strategies.ContextParallelStrategy
        --trainer.strategy.context_parallel_size=8 --trainer.strategy.method=ulysses``.
    """

    def __init__(
        self,
        context_parallel_size: int,
        method: Literal["ulysses", "ring"] = "ulysses",
        inner: str = SDPA_BY_DOCUMENT,
        ring_backend: Literal["all_gather", "torch"] = "all_gather",
        pad_token_id: int = 0,
        data_parallel_size: int | Literal["auto"] = "auto",
        tensor_parallel_size: int = 1,
        mixed_precision: str | dict[str, Any] | MixedPrecisionPolicy | None = None,
        reshard_after_forward: bool = True,
        cpu_offload: bool = False,
        save_distributed_checkpoint: bool = True,
        start_method: Literal["popen", "fork"] = "popen",
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        ParallelDims.check_sizes(context_parallel_size=context_parallel_size)
        if method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(map(repr, METHODS))}, got {method!r}.")
        if inner not in INNER_ATTENTIONS:
            raise ValueError(f"inner must be one of {sorted(INNER_ATTENTIONS)}, got {inner!r}.")
        if ring_backend not in RING_BACKENDS:
            raise ValueError(f"ring_backend must be one of {RING_BACKENDS}, got {ring_backend!r}.")
        if ring_backend == "torch" and method != "ring":
            raise ValueError(f"ring_backend='torch' is a ring kernel; it needs method='ring', got {method!r}.")
        if method == "ulysses":
            check_flash_attn(inner, "inner", SDPA_BY_DOCUMENT)
        super().__init__(
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=tensor_parallel_size,
            mixed_precision=mixed_precision,
            reshard_after_forward=reshard_after_forward,
            cpu_offload=cpu_offload,
            save_distributed_checkpoint=save_distributed_checkpoint,
            start_method=start_method,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self.context_parallel_size = context_parallel_size
        self.method = method
        self.inner = inner
        self.ring_backend = ring_backend
        self.pad_token_id = pad_token_id
        self._model_to_split: nn.Module | None = None
        self._attention: ContextParallelAttention | None = None
        self._layout: ShardLayout | None = None
        self._padding_logged = False
        self._rows_checked = False
        self._torch_ring = contextlib.ExitStack()

    @property
    @override
    def parallel_dims(self) -> ParallelDims:
        """This run's sizes: ``{"data_parallel": world / cp, "context_parallel": cp}`` as its mesh, context parallel
        innermost (the model is sharded over every rank: :attr:`fsdp_mesh` is the two flattened). With
        ``context_parallel_size=1`` it is :class:`~lit_memtrain.strategies.FSDP2Strategy`'s:
        ``{"data_parallel": world}``.

        Raises:
            ValueError: ``context_parallel_size`` does not divide the world size, or ``data_parallel_size`` is not
                the quotient.
        """
        return self._parallel_dims(self.context_parallel_size)

    @property
    def context_parallel_mesh(self) -> DeviceMesh:
        """The 1-D mesh of this rank's context-parallel group."""
        return self.device_mesh["context_parallel"]

    @override
    def setup_environment(self) -> None:
        try:
            datamodule = self.lightning_module.trainer.datamodule
        except (AttributeError, RuntimeError):  # no module, or one outside a Trainer: no data to check
            datamodule = None
        self.check_datamodule(datamodule)
        if self._uses_torch_ring() and self.root_device.type != "cuda":
            raise ValueError(
                f"ring_backend='torch' runs torch's ring kernels, on CUDA only; this run is on {self.root_device.type}. "
                "Use ring_backend='all_gather' (any device) or method='ulysses'."
            )
        # Head counts are checked from the module's config before any process group exists or any weight is read.
        recipe = getattr(self.lightning_module, "recipe", None)
        if recipe is not None and self.context_parallel_size > 1:
            from lit_memtrain.models.builder import causal_lm_config

            config = causal_lm_config(recipe, getattr(self.lightning_module, "tokenizer", None))
            check_context_parallel(config, self.context_parallel_size, self.method)
        super().setup_environment()

    def check_datamodule(self, datamodule: Any) -> None:
        """Refuse a datamodule that pads its batches: each row is split over the ranks of a group, which needs
        padding-free rows (documents kept apart by their positions).

        Called when the environment is set up, before any data is read or model built (the first sharded batch
        would show it only after both), and by ``lit-memtrain`` before it launches the ranks. A datamodule says how
        it batches with ``padding_free`` (``SFTDataModule``, ``PreferenceDataModule``); one that does not say is
        checked on its first batch (:func:`~lit_memtrain.parallel.context_parallel.shard_batch`).

        Raises:
            ValueError: ``datamodule.padding_free`` is False, naming the options that fix it.
        """
        if self.context_parallel_size == 1 or getattr(datamodule, "padding_free", None) is not False:
            return
        options = "padding_free=True (--data.padding_free true)"
        if hasattr(datamodule, "packing"):
            options += " or packing=True (--data.packing true)"
        raise ValueError(
            f"ContextParallelStrategy splits each row over {self.context_parallel_size} ranks and needs padding-free "
            f"batches (one row, documents kept apart by their positions), but {type(datamodule).__name__} pads its "
            f"batches (padding_free=False): set {options}."
        )

    @override
    def parallelize(self, model: nn.Module) -> nn.Module:
        """Check that ``method`` can split this model's heads, then shard it over every rank.

        Context-parallel attention is installed on this model when a stage starts (see the module docstring).
        """
        if self.context_parallel_size > 1:
            check_context_parallel(model.config, self.context_parallel_size, self.method, self.world_size)
            self._check_no_router_loss(model)
            self._model_to_split = model
        return super().parallelize(model)

    def _check_no_router_loss(self, model: nn.Module) -> None:
        """The router load-balancing loss is not a sum over tokens: computed on each rank's shard it is not one
        process's loss on the whole row, so it is refused rather than trained on silently."""
        hparams = getattr(self.lightning_module, "hparams", None) or {}
        coefficient = router_aux_coefficient(model, hparams.get("router_aux_loss_coef"))
        if coefficient:
            raise ValueError(
                f"{type(model).__name__} adds a router load-balancing loss (router_aux_loss_coef={coefficient}), which "
                "ContextParallelStrategy cannot compute over the whole row (each rank sees only its shard's router "
                "logits). Set router_aux_loss_coef=0 on the module to train without it, or use FSDP2Strategy."
            )

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        """This rank's shard of ``batch`` (see :func:`~lit_memtrain.parallel.context_parallel.shard_batch`), on the device."""
        if self.context_parallel_size == 1:
            return super().batch_to_device(batch, device, dataloader_idx)
        if not isinstance(batch, dict):
            raise TypeError(
                f"ContextParallelStrategy shards dict batches (input_ids, labels, ...); got {type(batch).__name__}."
            )
        mesh = self.context_parallel_mesh
        if not self._rows_checked:  # the first batch of each fit and validation run: a data set-up error shows there
            check_same_rows(batch, mesh.get_group(), self.root_device)
            self._rows_checked = True
        if self._attention is None:
            raise RuntimeError(
                "ContextParallelStrategy got a batch before its attention was installed: Lightning installs it when "
                "a stage starts (on_train_start, on_validation_start, ...); move batches only inside a Trainer run."
            )
        shard = shard_batch(batch, mesh.get_local_rank(), self.context_parallel_size, self.method, self.pad_token_id)
        self._log_padding(shard.layout)
        self._attention.set_layout(shard.layout)
        self._layout = shard.layout
        # Each rank's share of the rows' attention work, for the FLOP/s it logs (its local rows would undercount).
        shard.batch["attention_pairs"] = -(-int(attention_pairs(batch)) // self.context_parallel_size)
        return super().batch_to_device(shard.batch, device, dataloader_idx)

    def _install_attention(self) -> None:
        """Put context-parallel attention into the model :meth:`parallelize` sharded, once until it is uninstalled."""
        if self.context_parallel_size == 1 or self._attention is not None:
            return
        if self._model_to_split is None:
            raise RuntimeError(
                "ContextParallelStrategy has no model to split: none was sharded with strategy.parallelize(model). "
                "Build the model in the LightningModule's configure_model and shard it there (CausalLMModule does)."
            )
        mesh = self.context_parallel_mesh
        ring = (lambda layout: torch_ring_attention(mesh, layout)) if self._uses_torch_ring() else None
        # The probe computes as a training step does: under bf16-mixed, in autocast's dtype. Outside it the stage-start
        # hooks compute in the fp32 weights' dtype, which flash-attn's kernels (inner="flash_attention_2", the model's
        # own flash_attention_2) refuse, so a fit that trains fine failed before its first batch.
        with self.precision_plugin.forward_context():
            self._attention = install_checked_attention(
                self._model_to_split, mesh.get_group(), self.method, self.inner, self.ring_backend, self.pad_token_id,
                ring,
            )  # fmt: skip

    def _log_padding(self, layout: ShardLayout) -> None:
        if layout.padding and not self._padding_logged:
            self._padding_logged = True
            multiple = layout.cp_size * (2 if layout.method == "ring" else 1)
            rows = layout.length - layout.padding
            rank_zero_info(
                f"Context parallelism ({layout.method}, {layout.cp_size} ranks): rows of {rows} tokens padded with "
                f"{layout.padding} tokens to {layout.length} (a multiple of {multiple}); the padding is its own segment,"
                f" never attended to by a real token nor trained on. Logged once: any row gets at most {multiple - 1} "
                f"tokens of padding (none when its length is a multiple of {multiple})."
            )

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        self._install_attention()
        self._rows_checked = False

    @override
    def on_validation_start(self) -> None:
        super().on_validation_start()
        self._install_attention()
        self._rows_checked = False

    @override
    def on_test_start(self) -> None:
        super().on_test_start()
        self._install_attention()

    @override
    def on_predict_start(self) -> None:
        super().on_predict_start()
        self._install_attention()

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._close_torch_ring()
        if self._uses_torch_ring():
            self._torch_ring.enter_context(torch_ring_attention(self.context_parallel_mesh, self._layout))

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        try:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        finally:
            self._close_torch_ring()  # backward (checkpointed layers included) has run its ring kernels

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with contextlib.ExitStack() as stack:
            if self._uses_torch_ring():
                stack.enter_context(torch_ring_attention(self.context_parallel_mesh, self._layout))
            return super().validation_step(*args, **kwargs)

    def _uses_torch_ring(self) -> bool:
        return self.context_parallel_size > 1 and self.method == "ring" and self.ring_backend == "torch"

    def _close_torch_ring(self) -> None:
        self._torch_ring.close()
        self._torch_ring = contextlib.ExitStack()

    def _uninstall_attention(self) -> None:
        self._close_torch_ring()
        if self._attention is not None:
            self._attention.uninstall()
            self._attention = None
            self._layout = None

    @override
    def on_train_end(self) -> None:
        self._uninstall_attention()  # the model's own attention again, for what runs after fit (export, generate)

    @override
    def on_exception(self, exception: BaseException) -> None:
        self._close_torch_ring()

    @override
    def teardown(self) -> None:
        self._uninstall_attention()
        super().teardown()
