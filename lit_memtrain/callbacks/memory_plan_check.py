"""Lightning callback that plans a fit's GPU memory before the model is built, and warns if it will not fit.

Why a callback in ``setup`` and not a ``fit --plan-only`` flag: a LightningCLI run is configured by its
classes, and a callback is how a run gains behaviour there (``trainer.callbacks`` in the YAML, or
``--trainer.callbacks+=lit_memtrain.callbacks.MemoryPlanCheck``); it works the same for a Python script
that builds its own ``Trainer``, and it checks every fit instead of only the ones a user remembers to dry-run
(``lit-memtrain plan`` takes the same arguments and is the dry run). ``setup`` is the last hook before
Lightning calls ``configure_model``, where :class:`~lit_memtrain.objectives.causal_lm.CausalLMModule` builds the model and
loads the weights, so a configuration that cannot fit is caught before minutes of loading on a rented GPU.

How: the fit is described as the configuration LightningCLI would parse for it (the module's and the
datamodule's arguments, the precision, the strategy and the callbacks: :mod:`lit_memtrain.callbacks.live_fit`)
and handed to ``lit-memtrain plan`` in a child process (a simulation must run in a process of its own, see
:mod:`lit_memtrain.planner.simulate`), which refuses what it cannot plan with the reason. The callback imports
nothing of the planner, which sits above it. Only global rank 0 simulates; with ``stop=True`` every rank learns
the verdict and stops together.

Why the child starts when the callback is made: a new Python process spends several seconds importing torch,
transformers and Lightning before it simulates anything, more than a small plan's simulation. Made with the
callback, the child is forked from this process before the fit starts, with those imports done, or where that is
not safe is a new interpreter importing while the fit prepares its data (:mod:`lit_memtrain.callbacks.planner_process`);
either way the fit waits for little more than the simulation. It is started only where the check will run (a
``gpu_memory_gib``, or CUDA) and in the first process of a launch, and stopped when the fit ends or the callback is
dropped. Under a launcher that runs the ranks in processes of its own (``ddp_spawn``, ``ddp_fork``), rank 0 plans
in a new interpreter, and the launching process's child waits unused until that process ends.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lit_memtrain.callbacks.live_fit import fit_config
from lit_memtrain.callbacks.planner_process import PlannerProcess
from lit_memtrain.models.builder import ModelRecipe

__all__ = ["MemoryPlanCheck"]

_GIB = 2**30
_REFUSAL = "lit-memtrain plan: error: "  # what the planner prints before a configuration it cannot plan (status 2)


class MemoryPlanCheck(Callback):
    """Simulate one training step of the fit before the model is built; warn (or stop) if it will not fit.

    Needs a :class:`~lit_memtrain.objectives.causal_lm.CausalLMModule` and a datamodule with ``max_length`` and ``batch_size``
    such as :class:`~lit_memtrain.datamodules.sft.SFTDataModule`, or a :class:`~lit_memtrain.objectives.dpo.DPOModule` and a
    :class:`~lit_memtrain.datamodules.preference.PreferenceDataModule`, or a
    :class:`~lit_memtrain.objectives.grpo.GRPOModule` and a :class:`~lit_memtrain.datamodules.prompts.PromptDataModule`
    (the generation phase planned beside the training step, :mod:`lit_memtrain.planner.generation`); other modules
    are skipped with a warning.

    Args:
        gpu_memory_gib: memory of one GPU to plan for. Default: the training device's on CUDA; elsewhere the
            check is skipped unless this is given.
        margin: fraction of the GPU memory kept free for the CUDA context, kernel workspaces and fragmentation.
        stop: raise before the model is built when the plan does not fit, instead of warning.
        timeout: seconds the simulation may take (large models at long lengths take tens of seconds).

    Attributes:
        plan: the plan as ``lit-memtrain plan --json`` prints it, once ``setup`` has run on rank 0.

    Example:
        >>> from lit_memtrain.callbacks.memory_plan_check import MemoryPlanCheck
        >>> trainer = Trainer(callbacks=[GradientCheckpointing(), MemoryPlanCheck(stop=True)])  # doctest: +SKIP
    """

    def __init__(
        self, gpu_memory_gib: float | None = None, margin: float = 0.1, stop: bool = False, timeout: float = 900.0
    ) -> None:
        if gpu_memory_gib is not None and gpu_memory_gib <= 0:
            raise ValueError(f"gpu_memory_gib must be positive, got {gpu_memory_gib}.")
        if not 0 <= margin < 1:
            raise ValueError(f"margin is a fraction of the GPU memory in [0, 1), got {margin}.")
        if timeout <= 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout}.")
        self.gpu_memory_gib = gpu_memory_gib
        self.margin = margin
        self.stop = stop
        self.timeout = timeout
        self.plan: dict[str, Any] | None = None
        self._planner: PlannerProcess | None = PlannerProcess() if self._may_plan_in_this_process() else None

    def _may_plan_in_this_process(self) -> bool:
        """Whether this process is a launch's first (the one that plans) and the check will run in it."""
        first = all(os.environ.get(name, "0") == "0" for name in ("RANK", "LOCAL_RANK", "NODE_RANK", "SLURM_PROCID"))
        # device_count asks NVML, not CUDA: torch.cuda.is_available() here would break a later forking launcher.
        return first and (self.gpu_memory_gib is not None or torch.cuda.device_count() > 0)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_planner": None}  # a copy of the callback (a spawned rank) starts its own

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        message = None
        try:
            if trainer.is_global_zero:
                self.plan = self._plan(trainer, pl_module)
        finally:
            self._stop_planner()  # used, or not needed (another rank; a fit the check skips)
        if trainer.is_global_zero and self.plan is not None and not self.plan["fits"]:
            message = _not_fitting(self.plan)
        if self.stop:
            message = trainer.strategy.broadcast(message, src=0)
            if message is not None:
                raise RuntimeError(f"MemoryPlanCheck stopped the fit before the model was built. {message}")
        if message is not None:
            rank_zero_warn(message)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._stop_planner()

    def _stop_planner(self) -> None:
        if self._planner is not None:
            self._planner.stop()
            self._planner = None

    def _plan(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, Any] | None:
        if not isinstance(getattr(pl_module, "recipe", None), ModelRecipe):
            rank_zero_warn(f"MemoryPlanCheck plans CausalLMModule fits only; {type(pl_module).__name__} is skipped.")
            return None
        datamodule = trainer.datamodule
        lengths = ("max_length", "max_prompt_length")  # rows (SFT, DPO), or prompts a GRPO step completes
        if not hasattr(datamodule, "batch_size") or not any(hasattr(datamodule, name) for name in lengths):
            rank_zero_warn(
                "MemoryPlanCheck needs a datamodule with max_length (SFTDataModule) or max_prompt_length "
                "(PromptDataModule) and batch_size: skipped."
            )
            return None
        gpu_memory_gib = self.gpu_memory_gib
        device = trainer.strategy.root_device
        if gpu_memory_gib is None and device.type == "cuda":
            gpu_memory_gib = torch.cuda.get_device_properties(device).total_memory / _GIB
        if gpu_memory_gib is None:
            rank_zero_info(f"MemoryPlanCheck: training on {device.type}, not CUDA; give gpu_memory_gib to plan anyway.")
            return None
        planner, self._planner = self._planner or PlannerProcess(), None
        with tempfile.TemporaryDirectory() as directory:
            path = Path(directory) / "fit_config.json"
            path.write_text(json.dumps(fit_config(trainer, pl_module, datamodule)))
            arguments = ["--fit-config", str(path), "--json", "--gpu-memory", str(gpu_memory_gib),
                         "--margin", str(self.margin)]  # fmt: skip
            result = planner.run(arguments, self.timeout)
        stderr = result.stderr.strip()
        if result.returncode == 2 and _REFUSAL in stderr:  # a module, data or option the planner cannot plan
            rank_zero_warn(f"MemoryPlanCheck cannot plan this fit, skipped: {stderr.rsplit(_REFUSAL, 1)[1]}")
            return None
        if result.returncode != 0:
            rank_zero_warn(f"MemoryPlanCheck could not plan this fit: {stderr[-2000:]}")
            return None
        plan = json.loads(result.stdout)
        rank_zero_info(
            f"MemoryPlanCheck: simulated peak {plan['peak_device_bytes'] / _GIB:.2f} GiB per GPU in {plan['phase']}, "
            f"{plan['usable_bytes'] / _GIB:.2f} GiB usable: {'fits' if plan['fits'] else 'does NOT fit'}."
        )
        return plan


def _not_fitting(plan: dict[str, Any]) -> str:
    message = (
        f"This fit will not fit in GPU memory: one training step is simulated to peak at "
        f"{plan['peak_device_bytes'] / _GIB:.2f} GiB per GPU (in {plan['phase']}), and "
        f"{plan['usable_bytes'] / _GIB:.2f} GiB are usable ({plan['gpu_memory_bytes'] / _GIB:.2f} GiB less a "
        f"{plan['margin']:.0%} margin)."
    )
    suggestion = plan.get("suggestion")
    if suggestion and suggestion["fits"]:
        message += f" To fit, add: {'; '.join(suggestion['add'])}."
    elif suggestion:
        message += (
            f" Every memory technique together still peaks at {suggestion['peak_device_bytes'] / _GIB:.2f} GiB: lower "
            "data.max_length (`lit-memtrain plan --find-max-length` finds the longest that fits), train a LoRA "
            "adapter, or spread the model over more GPUs."
        )
    return message + " Details: `lit-memtrain plan` with the same arguments."
