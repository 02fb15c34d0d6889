"""FSDP2Strategy: Lightning's ModelParallelStrategy set up for sharding a causal LM over data-parallel ranks.

Why a strategy of our own rather than ``ModelParallelStrategy`` as it is: with its "auto" sizes on one node
the mesh is data-parallel 1 x tensor-parallel N, so the sampler gives every rank the same rows and nothing
is sharded or reduced, silently. Here the data-parallel size is the world size unless said otherwise, tensor
parallelism is refused before any work, and the FSDP2 options (mixed precision, resharding, host offload)
are arguments a config can set. The strategy owns the mesh (built by
:class:`~lit_memtrain.parallel.dims.ParallelDims`, which checks the sizes) and the sharding options; the
LightningModule builds its model in ``configure_model`` and hands it to :meth:`FSDP2Strategy.parallelize`
(:class:`~lit_memtrain.objectives.causal_lm.CausalLMModule` does; see :mod:`lit_memtrain.parallel.fsdp`).

``cpu_offload=True`` keeps the fp32 sharded parameters, their gradients and the optimizer state in host
memory and runs the optimizer step on the CPU; the device holds the layer being computed (in the
``mixed_precision`` dtype), the root's parameters, and activations. On CUDA the host memory is pinned; on a
machine without an accelerator it cannot be (``CPUOffloadPolicy(pin_memory=False)``). The gradients then live
on the host, so gradient clipping reduces their norm over a host tensor, which NCCL cannot carry: on CUDA the
process group gets a gloo backend for host tensors beside NCCL (``"cuda:nccl,cpu:gloo"``) unless the user names
a backend.
"""

from __future__ import annotations

import os
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher, _WorkerOutput
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy
from typing_extensions import override

from lit_memtrain.models.folder_write import PARTIAL_MARK, replace_folder
from lit_memtrain.parallel.dims import ParallelDims
from lit_memtrain.parallel.fsdp import mixed_precision_policy, parallelize

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["FSDP2Strategy"]

class FSDP2Strategy(ModelParallelStrategy):
    """Fully sharded data parallelism (torch FSDP2) of a causal LM, optionally with everything in host memory.

    Every rank trains on its own rows (the sampler splits the data over the ``data_parallel`` mesh
    dimension); parameters, gradients and optimizer state are split over the ranks, each decoder layer
    gathered only while it runs. Checkpoints are distributed (each rank writes its own shards) unless
    ``save_distributed_checkpoint=False``.

    Args:
        data_parallel_size: ranks that shard the model; ``"auto"`` is the world size (devices x nodes).
        tensor_parallel_size: must be 1: tensor parallelism is not supported, and asking for it fails here.
        mixed_precision: ``"bf16"`` gathers the parameters in bf16 for compute while the sharded (master)
            parameters stay in the model's dtype and gradients are reduced in fp32; a dict sets the
            ``MixedPrecisionPolicy`` fields by name; ``None`` computes in the model's dtype.
        reshard_after_forward: free each layer's gathered parameters after its forward and gather them again
            for its backward (``False``: every layer keeps them from its forward to its backward, one
            all-gather less per layer for the memory of all layers' gathered parameters).
        cpu_offload: keep sharded parameters, gradients and optimizer state in host memory (pinned on CUDA)
            and step the optimizer there. On CUDA the default backend is then ``"cuda:nccl,cpu:gloo"``, so that
            collectives over host tensors (the gradient norm of ``gradient_clip_val``) run.
        save_distributed_checkpoint: each rank writes its shards (a checkpoint directory); ``False`` gathers
            a single file on rank 0.
        start_method: ``"popen"`` relaunches the script once per extra device (like ``torchrun``);
            ``"fork"`` forks the current process (notebooks, tests; the trained weights come back to the
            calling process's module when it had built its model).
        process_group_backend, timeout: as for :class:`~lightning.pytorch.strategies.ModelParallelStrategy`; a
            ``process_group_backend`` given is used as is (``"nccl"`` alone with ``cpu_offload`` fails to clip).

    Example:
        >>> from lit_memtrain.strategies import FSDP2Strategy
        >>> strategy = FSDP2Strategy(mixed_precision="bf16", cpu_offload=True)
        >>> trainer = Trainer(accelerator="gpu", devices=8, strategy=strategy)  # doctest: +SKIP

        On the command line: ``--trainer.strategy=lit_memtrain.strategies.FSDP2Strategy
        --trainer.strategy.mixed_precision=bf16 --trainer.strategy.cpu_offload=true``.
    """

    def __init__(
        self,
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
        if tensor_parallel_size != 1:
            raise ValueError(
                f"FSDP2Strategy shards over data-parallel ranks only; tensor_parallel_size={tensor_parallel_size} "
                "(tensor parallelism) is not supported. Leave it at 1, or use Lightning's ModelParallelStrategy "
                "with a configure_model of your own for tensor parallelism."
            )
        ParallelDims.check_sizes(data_parallel_size=data_parallel_size)
        for name, value in (("reshard_after_forward", reshard_after_forward), ("cpu_offload", cpu_offload)):
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be True or False, got {value!r}.")
        if start_method not in ("popen", "fork"):
            raise ValueError(f"start_method must be 'popen' or 'fork', got {start_method!r}.")
        super().__init__(
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=1,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self.mp_policy = mixed_precision_policy(mixed_precision)
        self.save_distributed_checkpoint = save_distributed_checkpoint
        self.reshard_after_forward = reshard_after_forward
        self.cpu_offload = cpu_offload
        self.start_method = start_method
        self._fsdp_mesh: DeviceMesh | None = None

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Lightning's save, with a distributed checkpoint written into a folder beside ``filepath`` and renamed into
        place once every rank's shards and ``meta.pt`` are there. Lightning writes the shards over the previous
        checkpoint, so a kill during the save left a folder that looked complete (its old ``.metadata`` and
        ``meta.pt``) over a mix of old and new shards."""
        if not self.save_distributed_checkpoint or storage_options is not None:
            super().save_checkpoint(checkpoint, filepath, storage_options)
            return
        path = Path(self.broadcast(str(filepath)))
        partial = path.with_name(f".{path.name}{PARTIAL_MARK}{self.broadcast(os.getpid())}")
        super().save_checkpoint(checkpoint, partial)
        self.barrier("FSDP2Strategy.save_checkpoint: shards written")
        if self.global_rank == 0:
            replace_folder(partial, path)
        self.barrier("FSDP2Strategy.save_checkpoint: in place")

    @property
    def parallel_dims(self) -> ParallelDims:
        """This run's parallel sizes, checked against its world size (devices x nodes).

        Raises:
            ValueError: the sizes do not fit the world size.
        """
        return self._parallel_dims()

    def _parallel_dims(self, context_parallel_size: int = 1) -> ParallelDims:
        return ParallelDims(
            self.num_nodes * self.num_processes,
            context_parallel_size=context_parallel_size,
            data_parallel_size=self._data_parallel_size,
            world_size_source=f"{self.num_nodes} node(s) x {self.num_processes} device(s)",
        )

    def mesh_shape(self) -> dict[str, int]:
        """Size of each mesh dimension, outermost first (``{"data_parallel": world size}`` by default).

        Raises:
            ValueError: the sizes do not fit the world size (see :class:`~lit_memtrain.parallel.dims.ParallelDims`).
        """
        return self.parallel_dims.mesh_shape

    @property
    def fsdp_mesh(self) -> DeviceMesh:
        """The 1-D mesh the model is sharded over (and gradients are reduced over): every rank."""
        if self._fsdp_mesh is None:
            raise RuntimeError("The FSDP2 mesh exists once the processes are set up (setup_environment).")
        return self._fsdp_mesh

    def parallelize(self, model: nn.Module) -> nn.Module:
        """Shard ``model`` over :attr:`fsdp_mesh` with this strategy's options (see :func:`parallelize`)."""
        offload = CPUOffloadPolicy(pin_memory=self.root_device.type == "cuda") if self.cpu_offload else None
        return parallelize(
            model,
            self.fsdp_mesh,
            mp_policy=self.mp_policy,
            offload_policy=offload,
            reshard_after_forward=self.reshard_after_forward,
        )

    @property
    def parameter_device(self) -> torch.device:
        """Where sharded parameters live: the host with ``cpu_offload``, else the training device."""
        return torch.device("cpu") if self.cpu_offload else self.root_device

    @override
    def _configure_launcher(self) -> None:
        self.mesh_shape()  # a bad mesh fails here, when the Trainer is created, before any process starts
        assert self.cluster_environment is not None
        if self.cluster_environment.creates_processes_externally:
            return
        if self.start_method == "fork":
            self._launcher = _ForkLauncher(self)
        else:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    @override
    def _get_process_group_backend(self) -> str:
        """The backend ``setup_environment`` initialises: the user's, else ``"cuda:nccl,cpu:gloo"`` when
        ``cpu_offload`` puts the gradients on the host of a CUDA run (NCCL alone cannot reduce their norm for
        clipping), else Lightning's choice for the device (``nccl`` on CUDA, ``gloo`` on the CPU)."""
        if self._process_group_backend is None and self.cpu_offload and self.root_device.type == "cuda":
            return "cuda:nccl,cpu:gloo"
        return super()._get_process_group_backend()

    @override
    def setup_environment(self) -> None:
        self._setup_distributed()
        dims = self.parallel_dims
        if self.world_size != dims.world_size:
            raise RuntimeError(
                f"{type(self).__name__} expected {dims.world_size} processes but the process group has "
                f"{self.world_size}: check the launcher's --nproc_per_node / --nnodes against the Trainer's devices "
                "and num_nodes."
            )
        self._device_mesh, self._fsdp_mesh = dims.build_meshes(self.root_device.type)
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        if not self.cpu_offload:
            self.model.to(self.root_device)
            return
        # Sharded parameters stay in host memory (FSDP2 requires it); the rest (buffers such as RoPE
        # frequencies, metric states, the LightningModule's own device) goes to the device.
        sharded = [module for module in self.model.modules() if isinstance(module, FSDPModule)]
        outermost = [
            module for module in sharded if not any(other is not module and _contains(other, module) for other in sharded)
        ]
        _to_device_except(self.model, self.root_device, outermost)


def _contains(parent: nn.Module, child: nn.Module) -> bool:
    return any(module is child for module in parent.modules())


def _to_device_except(model: nn.Module, device: torch.device, keep: list[nn.Module]) -> None:
    """``model.to(device)``, except that the parameters of the modules in ``keep`` stay where they are.

    The modules in ``keep`` are taken out of the tree while ``model`` moves (so a LightningModule's device
    and everything else follow as usual), then put back; their buffers are moved on their own.
    """
    slots = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent._modules.items()
        if any(child is kept for kept in keep)
    ]
    for parent, name, _ in slots:
        parent._modules[name] = None
    try:
        if not any(model is kept for kept in keep):
            model.to(device)
    finally:
        for parent, name, child in slots:
            parent._modules[name] = child
    for kept in keep:
        for module in kept.modules():
            for name, buffer in module._buffers.items():
                if buffer is not None:
                    module._buffers[name] = buffer.to(device)


class _ForkLauncher(_MultiProcessingLauncher):
    """Lightning's fork launcher, returning the trained weights gathered into full tensors on rank 0.

    The stock launcher sends rank 0's ``state_dict()`` back to the calling process; under FSDP2 that holds
    only rank 0's shards, as ``DTensor``s.
    """

    def __init__(self, strategy: FSDP2Strategy) -> None:
        super().__init__(strategy, start_method="fork")

    @override
    def _collect_rank_zero_results(self, trainer: pl.Trainer, results: Any) -> _WorkerOutput | None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        module = trainer.lightning_module
        checkpoint_callback = trainer.checkpoint_callback
        best_model_path = getattr(checkpoint_callback, "best_model_path", None)
        state_dict = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self._strategy.local_rank != 0:
            return None
        weights_path = None
        if trainer.state.fn == TrainerFn.FITTING:
            weights_path = os.path.join(tempfile.mkdtemp(), ".temp.ckpt")
            self._strategy.checkpoint_io.save_checkpoint(state_dict, weights_path)
        return _WorkerOutput(best_model_path, weights_path, trainer.state, results, self.get_extra_results(trainer))
