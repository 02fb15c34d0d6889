"""One optimizer step of a ``fit`` configuration, simulated on fake tensors through ``CausalLMModule``.

Why through the module and the callbacks rather than a model-only step: what a run holds at its peak
depends on the code that runs it. The module's loss (chunked or plain, with its chunk size and LoRA head),
the callbacks' transforms (checkpointing modes, tiled MLPs, activation offloading), the precision plugin
(autocast's weight copies, a ``-true`` conversion), the optimizer :meth:`CausalLMModule.configure_optimizers`
builds, and Lightning's order of operations all change the peak, so each is the real one here.

The step, in Lightning's order for automatic optimisation (``lightning.pytorch.loops.optimization``):
1. Before it, the state of any step after the first: parameters, AdamW state, and the gradients of the
   previous step, which Lightning frees only after the next ``training_step`` (its ``zero_grad`` runs
   between the forward and the backward).
2. The callbacks' ``on_train_batch_start`` (activation offloading opens its context here).
3. ``compute_loss`` (what ``training_step`` returns) under the precision's context: autocast for
   ``*-mixed``, the default dtype for ``*-true``.
4. ``zero_grad(set_to_none=True)``, unless micro-batches accumulate: then the last micro-batch of an
   accumulation (the largest) runs its backward with the gradients of the earlier ones alive.
5. Backward, the optimizer step, the callbacks' ``on_train_batch_end``.

What differs from a GPU run, on purpose:
- The model's weights are never read: the model is built from its config (preset, local ``config.json`` or
  the hub cache) on the meta device, LoRA-wrapped and converted there, then placed on the stand-in device.
- Attention runs through the simulated O(L) flash kernel whatever ``attn_implementation`` says; the plan's
  notes give the size of what an implementation would add (eager's scores, sdpa's dense masks).
- AdamW is fused, as ``configure_optimizers`` chooses on CUDA (the stand-in device is not CUDA).
- Rows are full (``max_length`` tokens, every target trainable) and passed without ``position_ids`` (one
  document per row; transformers builds the same positions itself).
- A :class:`~lit_memtrain.objectives.dpo.DPOModule` step is its ``pair_loss`` (what its ``training_step`` returns): the
  policy over the ``2 x batch_size`` sequences of the pairs (chosen and rejected, each ``max_length`` tokens;
  padding-free, all of them in one row), the completion log-probabilities, and the reference's: read from the
  batch when precomputed (the pass before training runs without gradients and is not simulated, like validation),
  or the same model's forward without gradients and with the adapter disabled (``adapter_disabled``, LoRA).
- Under DDP every rank holds the whole model, plus one more copy of the gradients in DDP's communication
  buckets (Lightning's default ``gradient_as_bucket_view=False``), added as gradients.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily

from lit_memtrain.models.layers import find_decoder_layers
from lit_memtrain.models.lora import LoraSettings, apply_lora
from lit_memtrain.models.builder import DTYPES, ModelRecipe, causal_lm_config
from lit_memtrain.planner.per_rank import check_strategy, device_mesh, flash_sdpa, set_up_rank, shard_model
from lit_memtrain.planner.settings import PlanSettings, init_parameters
from lit_memtrain.planner.simulate import (
    STAND_IN_DEVICE,
    MemoryReport,
    fake_causal_lm,
    measure_peak,
    norm_probes_on_real_tensors,
    stand_in_device,
    tiles_simulated_once,
)
from lit_memtrain.planner.techniques import is_technique
from lit_memtrain.objectives.probes import LogitTransform

__all__ = ["StepSimulation", "simulate_fit_step"]

_TRUE_PRECISION_DTYPES = {"bf16-true": torch.bfloat16, "16-true": torch.float16, "64-true": torch.float64}
_MIXED_PRECISION_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


@dataclass(frozen=True)
class StepSimulation:
    """A simulated step: its memory, what was simulated, and what the simulation could not include.

    Attributes:
        memory: peaks, breakdown and phase (see :class:`~lit_memtrain.planner.simulate.MemoryReport`).
        max_length: tokens per row.
        parameters: parameters of the model (adapters included).
        trainable_parameters: those the optimizer updates.
        layers: decoder layers.
        notes: what the plan should say alongside the figures (assumptions, what is not included).
    """

    memory: MemoryReport
    max_length: int
    parameters: int
    trainable_parameters: int
    layers: int
    notes: tuple[str, ...]


@dataclass
class _StepTrainer:
    """What ``configure_optimizers`` and the memory callbacks read from the Trainer during the step."""

    accumulate_grad_batches: int = 1
    world_size: int = 1
    estimated_stepping_batches: int = 1


def simulate_fit_step(settings: PlanSettings, max_length: int | None = None) -> StepSimulation:
    """Simulate one optimizer step of ``settings`` with rows of ``max_length`` tokens (default: the settings').

    Call in a process of its own (see :func:`~lit_memtrain.planner.simulate.stand_in_device`); several
    calls in one process are fine.

    Raises:
        ValueError: what cannot be simulated (QLoRA, a model whose config cannot be read), with what to do.
    """
    max_length = settings.max_length if max_length is None else max_length
    if max_length < 1:
        raise ValueError(f"max_length must be at least 1 token, got {max_length}.")
    notes: list[str] = []
    module_class = _resolve_module_class(settings.module_class)
    module = module_class(**_module_arguments(settings.module, module_class))
    model_config = _model_config(module.recipe, settings, notes)
    build_dtype = _build_dtype(module.recipe, model_config)
    convert_dtype = _TRUE_PRECISION_DTYPES.get(settings.precision)
    callbacks = [spec.instantiate() for spec in settings.callbacks if is_technique(spec.resolve())]
    strategy = settings.strategy
    trainer = _StepTrainer(settings.accumulate_grad_batches, strategy.world_size)
    device = stand_in_device()
    check_strategy(strategy, model_config)

    def prepare(model: torch.nn.Module) -> torch.nn.Module:
        if module.lora is not None:
            model = apply_lora(model, module.lora)
        return model.to(dtype=convert_dtype) if convert_dtype is not None else model

    rank = None
    mesh, flat_mesh = device_mesh(strategy) if strategy.sharded else (None, None)
    with FakeTensorMode(allow_non_fake_inputs=True):
        module.model = fake_causal_lm(model_config, build_dtype, prepare)
        if flat_mesh is not None:
            shard_model(module.model, flat_mesh, strategy)
        module.trainer = trainer
        module._device = device  # what LightningModule.to(device) records; the weights are already there
        # The setup probes read values, which fake tensors have none of; a logit scale or cap the chunked loss
        # applies costs no memory worth simulating, so the plain head stands in for what the probe would find.
        module.setup_probes.assume_passed(logit_transform=LogitTransform())
        try:
            with norm_probes_on_real_tensors():
                for callback in callbacks:
                    callback.on_fit_start(trainer, module)
            optimizer = _steady_state_optimizer(module)
            batch = _batch(settings, max_length, getattr(module, "reference_mode", None))
            rank = set_up_rank(module.model, mesh, strategy, batch)
            # The document probe, too, reads values.
            module.setup_probes.assume_passed(document_attention=module.model.config._attn_implementation)
            notes += rank.notes
            buckets = _ddp_buckets(module, settings, notes)
            with tiles_simulated_once(), flash_sdpa():
                memory = measure_peak(
                    lambda: _lightning_step(module, optimizer, rank.batch, callbacks, settings),
                    module,
                    optimizer,
                    *(value for value in rank.batch.values() if isinstance(value, Tensor)),
                    labelled=[(bucket, "gradients") for bucket in buckets],
                    model=module.model,
                )
        finally:
            if rank is not None:
                rank.uninstall()
            for callback in callbacks:
                callback.teardown(trainer, module, "fit")
            module.trainer = None
    notes += _attention_notes(settings, max_length, model_config.num_attention_heads)
    if settings.preference:
        notes.append(_reference_note(module.reference_mode))
    parameters = sum(param.numel() for param in module.model.parameters())
    trainable = sum(param.numel() for param in module.model.parameters() if param.requires_grad)
    return StepSimulation(
        memory=memory,
        max_length=max_length,
        parameters=parameters,
        trainable_parameters=trainable,
        layers=len(find_decoder_layers(module.model)),
        notes=tuple(notes),
    )


def _resolve_module_class(class_path: str) -> type:
    """:class:`~lit_memtrain.objectives.causal_lm.CausalLMModule` or :class:`~lit_memtrain.objectives.dpo.DPOModule` (the settings checked
    that the path names one of them)."""
    import importlib

    module_name, _, name = class_path.rpartition(".")
    return getattr(importlib.import_module(module_name), name)


def _reference_note(reference_mode: str) -> str:
    if reference_mode == "adapter_disabled":
        return (
            "DPO, reference='adapter_disabled': each step also runs the model without gradients and with the LoRA "
            "adapter disabled over the same sequences (included)."
        )
    return (
        "DPO, reference='precomputed': each step reads the reference log-probabilities from the batch; the pass that "
        "computes them before training (without gradients, in batches of val_batch_size pairs) is not simulated, like "
        "validation."
    )


def _module_arguments(arguments: dict[str, Any], module_class: type) -> dict[str, Any]:
    """The module's own arguments, with what would load files or need a GPU taken out.

    The tokenizer is only needed for a preset's vocabulary (read in :func:`_model_config`); the attention
    implementation is replaced by the simulated kernel, so flash-attn need not be installed to plan for it.
    """
    accepted = init_parameters(module_class)
    values = {name: value for name, value in arguments.items() if name in accepted}
    lora = values.get("lora")
    if isinstance(lora, dict):
        lora = LoraSettings(**lora)
    if lora is not None and lora.quantize:
        raise ValueError(
            f"The planner does not simulate QLoRA (lora.quantize={lora.quantize!r}: 4/8-bit base weights) yet. "
            "Plan the configuration without lora.quantize for an upper bound (the base in bf16)."
        )
    return {**values, "lora": lora, "tokenizer": None, "attn_implementation": "sdpa"}


def _model_config(recipe: ModelRecipe, settings: PlanSettings, notes: list[str]):
    if recipe.model:
        try:
            return causal_lm_config(recipe, local_files_only=True)
        except OSError as error:
            raise ValueError(
                f"Cannot read the config of model={recipe.model!r} without the network. The planner reads only "
                "config.json (no weights), from a local directory or the Hugging Face cache: download it once "
                f"(huggingface-cli download {recipe.model} config.json), give a local directory that has it, or "
                f"plan a preset instead (--model.model=null --model.preset=..., see lit_memtrain.PRESETS). ({error})"
            ) from error
    tokenizer = None
    overrides = recipe.config_overrides or {}
    if settings.tokenizer and "vocab_size" not in overrides:
        try:
            tokenizer = _local_tokenizer(settings.tokenizer)
        except Exception as error:  # noqa: BLE001 - any failure to load leaves the preset's vocabulary
            vocabulary = causal_lm_config(recipe).vocab_size
            notes.append(
                f"Tokenizer {settings.tokenizer!r} could not be loaded here ({type(error).__name__}); the vocabulary "
                f"size is the model config's ({vocabulary}). Set model.config_overrides.vocab_size to plan another."
            )
    return causal_lm_config(recipe, tokenizer)


def _local_tokenizer(name: str):
    """The tokenizer whose length sets a preset's vocabulary, from local files only (never the network)."""
    from pathlib import Path

    from lit_memtrain.datamodules.embedded import EMBEDDED
    from lit_memtrain.datamodules.tokenizer import load_tokenizer

    if name == EMBEDDED or Path(name).exists():
        return load_tokenizer(name)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name, local_files_only=True)


def _build_dtype(recipe: ModelRecipe, model_config: Any) -> torch.dtype:
    if recipe.dtype != "auto":
        return DTYPES[recipe.dtype]
    if recipe.model:
        dtype = getattr(model_config, "dtype", None) or getattr(model_config, "torch_dtype", None)
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype, None)
        if isinstance(dtype, torch.dtype):
            return dtype
    return torch.float32


def _steady_state_optimizer(module: Any) -> torch.optim.Optimizer:
    """The module's optimizer, fused as on CUDA, with its state and the previous step's gradients in place."""
    with warnings.catch_warnings():  # its advice on low-precision weights is about training, not memory
        warnings.simplefilter("ignore")
        configured = module.configure_optimizers()
    optimizer = configured["optimizer"] if isinstance(configured, dict) else configured
    from torch.distributed.tensor import DTensor

    params = [param for group in optimizer.param_groups for param in group["params"]]
    if not any(isinstance(param, DTensor) for param in params):
        for group in optimizer.param_groups:
            group.update(fused=True, foreach=False)
    for param in params:
        param.grad = torch.zeros_like(param)
    optimizer.step()
    return optimizer


def _batch(settings: PlanSettings, max_length: int, reference_mode: str | None = None) -> dict[str, Any]:
    """The whole micro-batch: fake tensors on the stand-in device, or real CPU tensors when a context-parallel
    rank's shard is cut from it (``set_up_rank`` runs the real ``shard_batch``, which reads values).

    A DPO batch (:class:`~lit_memtrain.datamodules.preference_collate.PreferenceCollator`'s keys) has the pairs'
    ``2 x batch_size`` sequences, which sequence each token belongs to, and the reference log-probabilities when
    the module's ``reference_mode`` reads them from the batch (``precomputed``).
    """
    sequences = settings.sequences
    shape = (1, sequences * max_length) if settings.padding_free else (sequences, max_length)
    keys = ("input_ids", "labels", "sequence_ids") if settings.preference else ("input_ids", "labels")
    if settings.strategy.context_parallel_size > 1:  # never DPO: its settings refuse context parallelism
        with unset_fake_temporarily():
            return {key: torch.zeros(shape, dtype=torch.long) for key in keys}
    device = stand_in_device()
    batch: dict[str, Any] = {key: torch.zeros(shape, dtype=torch.long, device=device) for key in keys}
    if settings.preference:
        from lit_memtrain.datamodules.preference_collate import REFERENCE_COLUMNS

        batch["num_pairs"] = settings.batch_size
        if reference_mode == "precomputed":
            batch.update({name: torch.zeros(settings.batch_size, device=device) for name in REFERENCE_COLUMNS})
    return batch



def _ddp_buckets(module: Any, settings: PlanSettings, notes: list[str]) -> list[Tensor]:
    if settings.strategy.kind != "ddp":
        return []
    by_dtype: dict[torch.dtype, int] = {}
    for param in module.model.parameters():
        if param.requires_grad:
            by_dtype[param.dtype] = by_dtype.get(param.dtype, 0) + param.numel()
    buckets = [torch.empty(count, dtype=dtype, device=param.device) for dtype, count in by_dtype.items()]
    size = sum(bucket.nbytes for bucket in buckets)
    notes.append(
        f"DDP ({settings.strategy.world_size} ranks): each rank holds the whole model and DDP's gradient buckets, "
        f"{size / 2**30:.2f} GiB, counted as gradients (gradient_as_bucket_view=True in the DDP strategy would "
        "share them with the gradients)."
    )
    return buckets


def _lightning_step(
    module: Any, optimizer: torch.optim.Optimizer, batch: dict[str, Tensor], callbacks: list, settings: PlanSettings
) -> None:
    trainer = module.trainer
    for callback in callbacks:
        callback.on_train_batch_start(trainer, module, batch, 0)
    with _precision_context(settings.precision):
        loss = module.pair_loss(batch)[0] if settings.preference else module.compute_loss(batch)
    if settings.accumulate_grad_batches == 1:
        optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    for callback in callbacks:
        callback.on_train_batch_end(trainer, module, None, batch, 0)


@contextlib.contextmanager
def _precision_context(precision: str) -> Iterator[None]:
    """What Lightning's precision plugin wraps ``training_step`` in."""
    if precision in _MIXED_PRECISION_DTYPES:
        with torch.autocast(STAND_IN_DEVICE, dtype=_MIXED_PRECISION_DTYPES[precision]):
            yield
    elif precision in _TRUE_PRECISION_DTYPES:
        default = torch.get_default_dtype()
        torch.set_default_dtype(_TRUE_PRECISION_DTYPES[precision])
        try:
            yield
        finally:
            torch.set_default_dtype(default)
    else:
        yield


def _attention_notes(settings: PlanSettings, max_length: int, heads: int) -> list[str]:
    """What the configured attention would add to the simulated O(L) kernel, at ``max_length``."""
    name = settings.module.get("attn_implementation") or "sdpa"
    row = settings.sequences * max_length if settings.padding_free else max_length
    rows = 1 if settings.padding_free else settings.sequences
    square = rows * row * row
    if name == "eager":
        return [
            f"attn_implementation='eager' materialises heads x L x L attention scores: "
            f"{heads * square * 4 / 2**30:,.1f} GiB per layer in fp32 at {row:,} tokens, not included. Use sdpa or "
            "flash attention."
        ]
    if name == "sdpa" and settings.padding_free:
        return [
            f"attn_implementation='sdpa' on packed rows builds a dense L x L mask ({square / 2**30:,.1f} GiB at "
            f"{row:,} tokens), not included: use 'sdpa_by_document' or flash_attention_2 for packed rows."
        ]
    if name == "sdpa" and rows > 1:
        return [
            f"attn_implementation='sdpa' builds a [{rows}, 1, L, L] mask when a padded row has padding "
            f"({square / 2**30:,.1f} GiB at {row:,} tokens), not included."
        ]
    return []
