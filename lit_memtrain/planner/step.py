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
  notes give the size of what an implementation would add (eager's scores, sdpa's dense masks). The
  implementation planned for is the one named, else the one ``fit`` chooses on a CUDA GPU when none is named
  (:func:`~lit_memtrain.techniques.attention.choose_document_attention`: ``varlen_by_document`` with this
  torch, flash-attn's kernel where flash-attn is installed), whose memory that kernel's is; for
  ``varlen_by_document`` under a torch whose ``varlen_attn`` takes no grouped heads, with the key and value heads
  repeated first, as the fit does.
- AdamW is fused, as ``configure_optimizers`` chooses on CUDA (the stand-in device is not CUDA).
- Rows are full (``max_length`` tokens, every target trainable) and passed without ``position_ids`` (one
  document per row; transformers builds the same positions itself).
- A :class:`~lit_memtrain.objectives.reward.RewardModule` step is its ``pair_loss`` too, over the same batch: the
  decoder over the ``2 x batch_size`` sequences and the score head at each one's last token.
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
import dataclasses
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily

from lit_memtrain.models.layers import find_decoder_layers
from lit_memtrain.models.lora import LoraSettings, apply_lora
from lit_memtrain.models.builder import (
    DTYPES,
    ModelRecipe,
    auto_model_class,
    causal_lm_config,
    config_for_task,
    peft_task_type,
)
from lit_memtrain.planner.layers import (
    Reduction,
    applied_layers_differ,
    extrapolate,
    layers_differ,
    reduced_model_differs,
    technique_anchoring,
    with_layer_count,
)
from lit_memtrain.parallel.fsdp import mixed_precision_policy
from lit_memtrain.planner.per_rank import check_strategy, device_mesh, flash_sdpa, set_up_rank, shard_model
from lit_memtrain.planner.settings import DPO_MODULE, PlanSettings, init_parameters
from lit_memtrain.planner.simulate import (
    STAND_IN_DEVICE,
    MemoryReport,
    fake_causal_lm,
    key_value_heads_repeated,
    measure_segments,
    meta_causal_lm,
    norm_probes_on_real_tensors,
    stand_in_device,
    tiles_simulated_once,
)
from lit_memtrain.planner.techniques import is_technique
from lit_memtrain.planner.tracker import Segment
from lit_memtrain.objectives.probes import LogitTransform
from lit_memtrain.techniques.attention import (
    VARLEN_BY_DOCUMENT,
    choose_document_attention,
    varlen_repeats_key_value_heads,
)

__all__ = ["StepSimulation", "planned_attention", "simulate_fit_step"]

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
        vocab_size: rows of the embedding and of the LM head (a preset's own; the logits are tokens x this).
        notes: what the plan should say alongside the figures (assumptions, what is not included).
        attention: the attention implementation planned for (:func:`planned_attention`).
    """

    memory: MemoryReport
    max_length: int
    parameters: int
    trainable_parameters: int
    layers: int
    vocab_size: int
    notes: tuple[str, ...]
    attention: str


def planned_attention(settings: PlanSettings, model: torch.nn.Module) -> str:
    """The attention implementation a fit of ``settings`` runs ``model`` with on a CUDA GPU: the one named
    (``attn_implementation``), else what :class:`~lit_memtrain.objectives.causal_lm.CausalLMModule` chooses on the
    training device when none is named (:func:`~lit_memtrain.techniques.attention.choose_document_attention`)."""
    named = settings.module.get("attn_implementation")
    if named:
        return named
    dtype = settings.module.get("dtype")
    half_precision = dtype in ("bfloat16", "float16") or settings.precision.startswith(("bf16", "16"))
    return choose_document_attention(model, torch.device("cuda"), half_precision)


@dataclass(frozen=True)
class _StrategyView:
    """What the memory callbacks read from the Trainer's strategy: the FSDP2 policy it gathers parameters under."""

    mp_policy: Any = None


@dataclass
class _StepTrainer:
    """What ``configure_optimizers`` and the memory callbacks read from the Trainer during the step."""

    accumulate_grad_batches: int = 1
    world_size: int = 1
    estimated_stepping_batches: int = 1
    precision: str = "32-true"  # the precision plugin's name, which ChunkedRMSNorm's probe reads
    strategy: Any = None  # what a callback reads of the strategy: its FSDP2 ``mp_policy`` (``None`` unsharded)


def simulate_fit_step(
    settings: PlanSettings, max_length: int | None = None, *, whole: bool = False
) -> StepSimulation:
    """Simulate one optimizer step of ``settings`` with rows of ``max_length`` tokens (default: the settings').

    A model whose decoder layers are identical is simulated with a few of them, twice, and its figures extrapolated
    to all of them, exactly (:mod:`lit_memtrain.planner.layers`); one whose layers cannot be shown identical, or
    whose techniques the planner cannot show to treat every layer alike, is simulated whole, and its notes say why.
    ``whole=True`` simulates every layer anyway (what the extrapolation is tested against).

    Call in a process of its own (see :func:`~lit_memtrain.planner.simulate.stand_in_device`); several
    calls in one process are fine.

    Raises:
        ValueError: what cannot be simulated (QLoRA, a model whose config cannot be read), with what to do.
    """
    max_length = settings.max_length if max_length is None else max_length
    if max_length < 1:
        raise ValueError(f"max_length must be at least 1 token, got {max_length}.")
    model = _ModelPlan.of(settings)
    reduction = "" if whole else _reduction(settings, model)
    if isinstance(reduction, Reduction):
        try:
            smaller = [_simulate(settings, model, max_length, count) for count in reduction.counts]
        except _SimulateWhole as refusal:
            reduction = str(refusal)
        else:
            memory = extrapolate([(simulated.step.memory, simulated.segments) for simulated in smaller], reduction)
            if isinstance(memory, MemoryReport):
                return _extrapolated(smaller, memory, reduction.layers, settings)
            reduction = memory
    whole = _simulate(settings, model, max_length)
    step = whole.step
    if reduction:
        note = f"Simulated with all {step.layers} decoder layers (slower): {reduction}."
        step = dataclasses.replace(step, notes=(*step.notes, note))
    return step


class _SimulateWhole(Exception):
    """The model cannot be simulated with fewer layers (the message says why): simulate it whole."""


@dataclass(frozen=True)
class _ModelPlan:
    """What every simulation of one configuration builds its model from, read once."""

    module_class: type
    arguments: dict[str, Any]
    recipe: ModelRecipe
    lora: LoraSettings | None
    config: Any
    build_dtype: torch.dtype
    convert_dtype: torch.dtype | None
    notes: tuple[str, ...]

    @classmethod
    def of(cls, settings: PlanSettings) -> _ModelPlan:
        notes: list[str] = []
        module_class = _resolve_module_class(settings.module_class)
        arguments = _module_arguments(settings.module, module_class)
        module = module_class(**arguments)
        model_config = _task_config(_model_config(module.recipe, settings, notes), module.recipe)
        return cls(
            module_class=module_class,
            arguments=arguments,
            recipe=module.recipe,
            lora=module.lora,
            config=model_config,
            build_dtype=_build_dtype(module.recipe, model_config),
            convert_dtype=_TRUE_PRECISION_DTYPES.get(settings.precision),
            notes=tuple(notes),
        )

    @property
    def model_class(self) -> type:
        return auto_model_class(self.recipe)

    def prepare(self, model: torch.nn.Module) -> torch.nn.Module:
        """What the module does to the model before it is placed (on the meta device): LoRA, a ``-true`` dtype."""
        if self.lora is not None:
            model = apply_lora(model, self.lora, peft_task_type(self.recipe))
        return model.to(dtype=self.convert_dtype) if self.convert_dtype is not None else model

    def meta_model(self, layers: int | None = None) -> torch.nn.Module:
        config = self.config if layers is None else with_layer_count(self.config, layers)
        return meta_causal_lm(config, self.build_dtype, self.prepare, self.model_class)


def _reduction(settings: PlanSettings, model: _ModelPlan) -> Reduction | str:
    """How the step's model is simulated with fewer layers, or why it is simulated whole ("" when it has too few
    layers for that to be quicker)."""
    callbacks = [spec.instantiate() for spec in settings.callbacks if is_technique(spec.resolve())]
    anchored = technique_anchoring(callbacks)
    if isinstance(anchored, str):
        return anchored
    reduction = Reduction(model.config.get_text_config().num_hidden_layers, anchored)
    if not reduction.worthwhile:
        return ""
    refusal = _identical_layers(model)
    return reduction if refusal is None else refusal


def _identical_layers(model: _ModelPlan) -> str | None:
    """Why the model's layers cannot be shown identical, or None; checked once per model and process."""
    key = (model.config.to_json_string(), model.build_dtype, model.convert_dtype, repr(model.lora), model.model_class)
    if key not in _LAYER_CHECKS:
        whole = model.meta_model()
        refusal = layers_differ(whole)
        if refusal is None:
            refusal = reduced_model_differs(whole, model.meta_model(3))
        _LAYER_CHECKS[key] = refusal
    return _LAYER_CHECKS[key]


_LAYER_CHECKS: dict[tuple[Any, ...], str | None] = {}


@dataclass(frozen=True)
class _Simulated:
    step: StepSimulation
    segments: tuple[Segment, ...]  # the step's phases, as measure_segments gives them
    ddp_buckets: int  # bytes of DDP's gradient buckets (0 without DDP)


def _extrapolated(
    smaller: list[_Simulated], memory: MemoryReport, layers: int, settings: PlanSettings
) -> StepSimulation:
    """The step of the whole model from its two smaller simulations (``memory`` extrapolated from theirs)."""
    first, second = (simulated.step for simulated in smaller)
    grown = layers - first.layers

    def extrapolated(a: int, b: int) -> int:
        return a + (b - a) * grown

    buckets = extrapolated(smaller[0].ddp_buckets, smaller[1].ddp_buckets)
    notes = [note for note in second.notes if not note.startswith(_DDP_NOTE)]
    return dataclasses.replace(
        second,
        memory=memory,
        parameters=extrapolated(first.parameters, second.parameters),
        trainable_parameters=extrapolated(first.trainable_parameters, second.trainable_parameters),
        layers=layers,
        notes=(*_ddp_notes(settings, buckets), *notes),
    )


def _simulate(settings: PlanSettings, model: _ModelPlan, max_length: int, layers: int | None = None) -> _Simulated:
    """One step, of the whole model or of the same model with ``layers`` decoder layers.

    Raises:
        _SimulateWhole: with ``layers``, the techniques or the strategy do not treat the layers alike.
    """
    notes = list(model.notes)
    module = model.module_class(**model.arguments)
    model_config = model.config if layers is None else with_layer_count(model.config, layers)
    callbacks = [spec.instantiate() for spec in settings.callbacks if is_technique(spec.resolve())]
    strategy = settings.strategy
    trainer = _StepTrainer(
        settings.accumulate_grad_batches, strategy.world_size, precision=settings.precision,
        strategy=_StrategyView(mixed_precision_policy(strategy.mixed_precision) if strategy.sharded else None),
    )  # fmt: skip
    device = stand_in_device()
    check_strategy(strategy, model_config)

    rank = None
    mesh, flat_mesh = device_mesh(strategy) if strategy.sharded else (None, None)
    with FakeTensorMode(allow_non_fake_inputs=True):
        module.model = fake_causal_lm(model_config, model.build_dtype, model.prepare, model.model_class)
        if flat_mesh is not None:
            shard_model(module.model, flat_mesh, strategy)
        module.trainer = trainer
        module._device = device  # what LightningModule.to(device) records; the weights are already there
        # The setup probes read values, which fake tensors have none of; a logit scale or cap the chunked loss
        # applies costs no memory worth simulating, so the plain head stands in for what the probe would find.
        module.setup_probes.assume_passed(logit_transform=LogitTransform())
        attention = planned_attention(settings, module.model)
        try:
            with norm_probes_on_real_tensors():
                for callback in callbacks:
                    callback.on_fit_start(trainer, module)
            refusal = applied_layers_differ(module.model) if layers is not None else None
            if refusal is not None:
                raise _SimulateWhole(refusal)
            optimizer = _steady_state_optimizer(module)
            batch = _batch(settings, max_length, getattr(module, "reference_mode", None))
            rank = set_up_rank(module.model, mesh, strategy, batch)
            # The document probe, too, reads values.
            module.setup_probes.assume_passed(document_attention=module.model.config._attn_implementation)
            notes += rank.notes
            buckets = _ddp_buckets(module, settings)
            repeated = attention == VARLEN_BY_DOCUMENT and varlen_repeats_key_value_heads()
            with tiles_simulated_once(), flash_sdpa(), key_value_heads_repeated(repeated):
                memory, segments = measure_segments(
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
    bucket_bytes = sum(bucket.nbytes for bucket in buckets)
    notes = [*_ddp_notes(settings, bucket_bytes), *notes]
    notes += _attention_notes(settings, attention, max_length, model_config)
    if settings.module_class == DPO_MODULE:
        notes.append(_reference_note(module.reference_mode))
    parameters = sum(param.numel() for param in module.model.parameters())
    trainable = sum(param.numel() for param in module.model.parameters() if param.requires_grad)
    step = StepSimulation(
        memory=memory,
        max_length=max_length,
        parameters=parameters,
        trainable_parameters=trainable,
        layers=len(find_decoder_layers(module.model)),
        vocab_size=model_config.vocab_size,
        notes=tuple(notes),
        attention=attention,
    )
    return _Simulated(step, segments, bucket_bytes)


def _resolve_module_class(class_path: str) -> type:
    """:class:`~lit_memtrain.objectives.causal_lm.CausalLMModule`, :class:`~lit_memtrain.objectives.dpo.DPOModule` or
    :class:`~lit_memtrain.objectives.reward.RewardModule` (the settings checked that the path names one of them)."""
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

    The tokenizer is only needed to check that it fits the model's vocabulary (in :func:`_model_config`); the attention
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
                f"(hf download {recipe.model} config.json), give a local directory that has it, or "
                f"plan a preset instead (--model.preset=..., see lit_memtrain.PRESETS). ({error})"
            ) from error
    tokenizer = None
    if settings.tokenizer:
        try:
            tokenizer = _local_tokenizer(settings.tokenizer)
        except Exception as error:  # noqa: BLE001 - any failure to load leaves the fit unchecked, and said so
            vocabulary = causal_lm_config(recipe).vocab_size
            notes.append(
                f"Tokenizer {settings.tokenizer!r} could not be loaded here ({type(error).__name__}): the vocabulary "
                f"is the model config's ({vocabulary:,}), and whether the tokenizer fits inside it is not checked."
            )
    return causal_lm_config(recipe, tokenizer)


def _task_config(config: Any, recipe: ModelRecipe) -> Any:
    """The config of the model the module trains: a reward model's has one label, and a pad token id to read its
    rewards past (0 when neither the config nor a tokenizer gave one: which token is read costs no memory)."""
    config = config_for_task(config, recipe)
    if recipe.task == "reward" and config.get_text_config().pad_token_id is None:
        config.get_text_config().pad_token_id = 0
    return config


def _local_tokenizer(name: str):
    """The tokenizer that must fit the model's vocabulary (and that fills a config dict's), from local files only
    (never the network)."""
    from pathlib import Path

    from lit_memtrain.datamodules.embedded import EMBEDDED
    from lit_memtrain.datamodules.gguf_files import PACKAGED_GGUF
    from lit_memtrain.datamodules.tokenizer import load_tokenizer

    if name == EMBEDDED or Path(name).exists() or name in PACKAGED_GGUF:
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



def _ddp_buckets(module: Any, settings: PlanSettings) -> list[Tensor]:
    if settings.strategy.kind != "ddp":
        return []
    by_dtype: dict[torch.dtype, int] = {}
    for param in module.model.parameters():
        if param.requires_grad:
            by_dtype[param.dtype] = by_dtype.get(param.dtype, 0) + param.numel()
    return [torch.empty(count, dtype=dtype, device=param.device) for dtype, count in by_dtype.items()]


_DDP_NOTE = "DDP ("


def _ddp_notes(settings: PlanSettings, size: int) -> list[str]:
    """What the plan says of DDP's gradient buckets (``size`` bytes), under DDP."""
    if settings.strategy.kind != "ddp":
        return []
    return [
        f"{_DDP_NOTE}{settings.strategy.world_size} ranks): each rank holds the whole model and DDP's gradient "
        f"buckets, {size / 2**30:.2f} GiB, counted as gradients (gradient_as_bucket_view=True in the DDP strategy "
        "would share them with the gradients)."
    ]


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


def _attention_notes(settings: PlanSettings, name: str, max_length: int, config: Any) -> list[str]:
    """Which attention ``name`` is when chosen as ``fit`` would choose it, and what it would add to the simulated
    O(L) kernel at ``max_length``."""
    notes = [] if settings.module.get("attn_implementation") else [
        f"Attention: {name!r}, what fit chooses on a CUDA GPU when none is named."
    ]  # fmt: skip
    heads = config.num_attention_heads
    row = settings.sequences * max_length if settings.padding_free else max_length
    rows = 1 if settings.padding_free else settings.sequences
    square = rows * row * row
    key_value_heads = getattr(config, "num_key_value_heads", None) or heads
    if name == VARLEN_BY_DOCUMENT and key_value_heads != heads and varlen_repeats_key_value_heads():
        notes.append(
            f"varlen_attn of torch {torch.__version__} takes no grouped key/value heads: varlen_by_document repeats "
            f"the {key_value_heads} key and value heads to {heads} in every layer, and each layer keeps the repeated "
            "ones for its backward (simulated)."
        )
    if name == "eager":
        notes.append(
            f"attn_implementation='eager' materialises heads x L x L attention scores: "
            f"{heads * square * 4 / 2**30:,.1f} GiB per layer in fp32 at {row:,} tokens, not included. Use sdpa or "
            "flash attention."
        )
    elif name == "sdpa" and settings.padding_free:
        notes.append(
            f"attn_implementation='sdpa' on packed rows builds a dense L x L mask ({square / 2**30:,.1f} GiB at "
            f"{row:,} tokens), not included: use 'sdpa_by_document' or flash_attention_2 for packed rows."
        )
    elif name == "sdpa" and rows > 1:
        notes.append(
            f"attn_implementation='sdpa' builds a [{rows}, 1, L, L] mask when a padded row has padding "
            f"({square / 2**30:,.1f} GiB at {row:,} tokens), not included."
        )
    return notes
