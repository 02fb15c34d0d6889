"""Building and loading the Hugging Face causal LM a module trains, and writing it back out.

A recipe with ``task="reward"`` builds the same decoder under a one-output score head instead
(``AutoModelForSequenceClassification``, :func:`auto_model_class`), for a reward model; everything below applies to
it as it is.

Why apart from the training step: where and when the model is built depends on the strategy (on the
training device directly, or on the meta device and then sharded and loaded per rank), and an export
must rebuild exactly what was trained (a QLoRA base reloaded in a float dtype with the same constructor
options). Keeping these here leaves :mod:`lit_memtrain.objectives.causal_lm` with the training step only.

- :func:`build_training_model`: the model as a run trains it (attention chosen, tokenizer checked, LoRA applied);
- :func:`build_sharded_training_model`: the same, sharded as it is built: global rank 0 loads (or initialises)
  the full model in host memory, the other ranks build it on the meta device; every rank shards it with the
  strategy's ``parallelize`` and receives its shards from rank 0 one tensor at a time (:func:`load_sharded`), so
  no device ever holds the whole model;
- :func:`export_hf_directory` / :func:`export_sharded_hf_directory`: a Hugging Face directory of what was trained.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    GgufConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from lit_memtrain.datamodules.gguf_files import find_gguf
from lit_memtrain.datamodules.hub_access import require_hub
from lit_memtrain.datamodules.tokenizer import load_tokenizer
from lit_memtrain.models.folder_write import write_folder
from lit_memtrain.models.lora import (
    LoraSettings,
    apply_lora,
    check_quantization_available,
    is_peft_model,
    merged_copy,
    quantization_config,
)
from lit_memtrain.models.presets import PRESETS, build_config
from lit_memtrain.models.rope_override import check_rope_override

__all__ = [
    "DTYPES",
    "MODEL_TASKS",
    "ModelRecipe",
    "ModelTask",
    "auto_model_class",
    "build_causal_lm",
    "build_causal_lm_skeleton",
    "build_sharded_training_model",
    "build_training_model",
    "causal_lm_config",
    "check_tokenizer_fits_model",
    "config_for_task",
    "export_hf_directory",
    "export_sharded_hf_directory",
    "gguf_tokenizer",
    "load_sharded",
    "peft_task_type",
    "pretrained_source",
    "reload_unquantized_base",
    "set_score_padding",
]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# What the model computes: next-token logits, or one score per sequence (a reward model, see auto_model_class).
ModelTask = Literal["causal_lm", "reward"]
MODEL_TASKS = ("causal_lm", "reward")
_PEFT_TASK_TYPES = {"causal_lm": "CAUSAL_LM", "reward": "SEQ_CLS"}  # SEQ_CLS trains the score head whole


@dataclass(frozen=True)
class ModelRecipe:
    """Everything needed to build (and rebuild for export) the causal LM of a run.

    Exactly one of ``model`` (hub id, local path, GGUF file: :func:`pretrained_source`), ``preset`` (a
    :data:`~lit_memtrain.models.presets.PRESETS` name) or ``config`` (a dict with ``model_type``) is set. See
    :class:`~lit_memtrain.objectives.causal_lm.CausalLMModule` for the meaning of each field; ``task`` says
    which head the model has (:func:`auto_model_class`).
    """

    model: str | None = None
    preset: str | None = None
    config: dict[str, Any] | None = None
    config_overrides: dict[str, Any] | None = None
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"
    attn_implementation: str | None = "sdpa"  # None: transformers' default (sdpa where the model supports it)
    model_init_kwargs: dict[str, Any] = field(default_factory=dict)
    trust_remote_code: bool = False
    lora: LoraSettings | None = None
    task: ModelTask = "causal_lm"

    def __post_init__(self) -> None:
        sources = [name for name in ("model", "preset", "config") if getattr(self, name)]
        if len(sources) != 1:
            raise ValueError(
                f"Give exactly one of model (hub id or path), preset (one of lit_memtrain.PRESETS) or config "
                f"(a dict with model_type); got {sources or 'none'}."
            )
        if self.preset and self.preset not in PRESETS:
            raise ValueError(f"Unknown model preset {self.preset!r}. Known presets: {', '.join(sorted(PRESETS))}.")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {[*DTYPES, 'auto']}, got {self.dtype!r}.")
        if self.lora is not None and self.lora.quantize and not self.model:
            raise ValueError(
                "QLoRA (lora.quantize) quantizes a checkpoint while loading it: give model=<hub id or path>."
            )
        if self.task not in MODEL_TASKS:
            raise ValueError(f"task must be one of {MODEL_TASKS}, got {self.task!r}.")
        if self.task == "reward" and self.lora is not None and self.lora.lm_head:
            raise ValueError(
                "lora.lm_head adapts an LM head, which a reward model does not have: its score head trains whole "
                "(PEFT's modules_to_save). Drop lora.lm_head."
            )
        if self.quantized:
            if pretrained_source(self)[1].get("gguf_file"):
                raise ValueError(
                    f"QLoRA (lora.quantize) quantizes a checkpoint while loading it, and {self.model!r} is a GGUF "
                    "file, which transformers dequantizes to float as it loads it. Train a plain LoRA adapter (drop "
                    "lora.quantize), or export the model to a Hugging Face directory first and quantize that."
                )
            check_quantization_available(self.lora)

    @property
    def quantized(self) -> bool:
        return self.lora is not None and self.lora.quantize is not None


def pretrained_source(recipe: ModelRecipe) -> tuple[str, dict[str, Any]]:
    """Where ``from_pretrained`` reads ``recipe.model`` from, and the ``model_init_kwargs`` it takes.

    A GGUF file (a ``.gguf`` path, a packaged model's short name such as ``smollm2-135m-instruct``, or a directory or
    hub id with ``gguf_file`` in ``model_init_kwargs``: :func:`~lit_memtrain.datamodules.gguf_files.find_gguf`) is
    read from its directory with ``gguf_file`` its name, and ``GgufConfig(dequantize=True)``: every weight becomes a
    plain float tensor, which trains, shards and saves as any checkpoint's (transformers would otherwise keep some
    architectures' weights in GGUF blocks, which neither train nor save). Any other model is read as it is named.
    """
    init_kwargs = dict(recipe.model_init_kwargs)
    gguf = find_gguf(recipe.model, init_kwargs.pop("gguf_file", None))
    if gguf is None:
        return recipe.model, dict(recipe.model_init_kwargs)
    return gguf.location, {**init_kwargs, "gguf_file": gguf.name}


def gguf_tokenizer(recipe: ModelRecipe) -> PreTrainedTokenizerBase | None:
    """A GGUF model's own tokenizer (chat template included), which a module given no tokenizer trains and exports
    with; None for a model of another source (a checkpoint directory's tokenizer is not guessed)."""
    source, init_kwargs = pretrained_source(recipe) if recipe.model else (None, {})
    if not init_kwargs.get("gguf_file"):
        return None
    return load_tokenizer(source, init_kwargs["gguf_file"])


def _gguf_dequantized(init_kwargs: dict[str, Any]) -> dict[str, Any]:
    """``from_pretrained``'s quantization option for a GGUF file's weights: dequantized to float."""
    return {"quantization_config": GgufConfig(dequantize=True)} if init_kwargs.get("gguf_file") else {}


def auto_model_class(recipe: ModelRecipe) -> type:
    """``AutoModelForCausalLM``, or for ``task="reward"`` ``AutoModelForSequenceClassification`` with one output:
    the decoder of the same checkpoint or preset under a ``score`` head (a hub causal LM loads into it with a new,
    randomly initialised head, as TRL's ``RewardTrainer`` loads it)."""
    return AutoModelForSequenceClassification if recipe.task == "reward" else AutoModelForCausalLM


def _task_kwargs(recipe: ModelRecipe) -> dict[str, Any]:
    return {"num_labels": 1} if recipe.task == "reward" else {}


def config_for_task(config: PretrainedConfig, recipe: ModelRecipe) -> PretrainedConfig:
    """``config`` (a fresh one) with what :func:`auto_model_class`'s class needs: one label for a reward model."""
    for name, value in _task_kwargs(recipe).items():
        setattr(config, name, value)
    return config


def peft_task_type(recipe: ModelRecipe) -> str:
    """PEFT's ``task_type`` for the recipe's model: ``SEQ_CLS`` keeps a reward model's score head trainable (PEFT's
    ``modules_to_save``, as TRL advises), since the head starts from random weights."""
    return _PEFT_TASK_TYPES[recipe.task]


def set_score_padding(model: nn.Module, tokenizer: PreTrainedTokenizerBase | None) -> None:
    """Give a reward model's config the tokenizer's pad token id, as TRL's ``RewardTrainer`` does.

    Why: a sequence-classification model reads each sequence's score at its rightmost token that is not
    ``config.pad_token_id`` (so with ``pad == eos`` a trailing eos counts as padding); the batches are padded with
    the tokenizer's pad token, and an export must read the same position. Without a tokenizer the config's own id is
    kept.

    Raises:
        ValueError: neither the tokenizer nor the config has a pad token id.
    """
    config = model.config.get_text_config()
    if tokenizer is not None:
        config.pad_token_id = tokenizer.pad_token_id
    if config.pad_token_id is None:
        raise ValueError(
            f"The reward model {type(model).__name__} has no pad token id, so the position its score is read at "
            "cannot be found. Give the module a tokenizer (its pad token, or its eos token when it has none, is "
            "used), or set config_overrides.pad_token_id."
        )


def build_causal_lm(recipe: ModelRecipe, tokenizer: PreTrainedTokenizerBase | None = None) -> PreTrainedModel:
    """Load ``recipe.model`` with ``from_pretrained``, or build random weights from a preset or config.

    A model built from a preset or config takes its shape from it and its special token ids from ``tokenizer``
    (see :func:`causal_lm_config`); a reward recipe's model has a score head (:func:`auto_model_class`). The model
    is built where the caller's device context puts it.
    """
    _check_rope_parameters(recipe)
    dtype = "auto" if recipe.dtype == "auto" else DTYPES[recipe.dtype]
    common = {"attn_implementation": recipe.attn_implementation, "trust_remote_code": recipe.trust_remote_code}
    if recipe.model:
        source, init_kwargs = pretrained_source(recipe)
        require_hub(source, "model")
        init_kwargs.update(_gguf_dequantized(init_kwargs))
        if recipe.quantized:
            compute_dtype = torch.bfloat16 if dtype in ("auto", torch.float32) else dtype
            init_kwargs["quantization_config"] = quantization_config(recipe.lora, compute_dtype)
            # Quantized weights load straight onto a GPU: this process's own, not always cuda:0 under DDP.
            init_kwargs.setdefault("device_map", {"": int(os.environ.get("LOCAL_RANK", 0))})
        model_class = auto_model_class(recipe)
        return model_class.from_pretrained(source, dtype=dtype, **common, **_task_kwargs(recipe), **init_kwargs)
    model_config = config_for_task(causal_lm_config(recipe, tokenizer), recipe)
    dtype = torch.float32 if dtype == "auto" else dtype
    return auto_model_class(recipe).from_config(model_config, dtype=dtype, **common)


def _check_rope_parameters(recipe: ModelRecipe) -> None:
    """Refuse a ``rope_parameters`` override (``model_init_kwargs``, or a preset's ``config_overrides``) that drops
    keys of the model's own (:func:`~lit_memtrain.models.rope_override.check_rope_override`): its config is read
    without the override to compare."""
    if recipe.model:
        source, init_kwargs = pretrained_source(recipe)
        override = init_kwargs.pop("rope_parameters", None)
        if not isinstance(override, dict):
            return
        own = AutoConfig.from_pretrained(source, trust_remote_code=recipe.trust_remote_code, **init_kwargs)
    else:
        overrides = {**(recipe.config_overrides or {}), **recipe.model_init_kwargs}
        override = overrides.pop("rope_parameters", None)
        if not isinstance(override, dict):
            return
        own = build_config(recipe.preset or recipe.config, overrides)
    check_rope_override(own, override)


def causal_lm_config(
    recipe: ModelRecipe, tokenizer: PreTrainedTokenizerBase | None = None, local_files_only: bool = False
) -> PretrainedConfig:
    """The config of the model ``build_causal_lm`` builds, without building it or reading any weights.

    For ``recipe.model`` this reads ``config.json`` (a local directory, or the hub or, with ``local_files_only``,
    only its cache; a GGUF file's metadata for a GGUF model, :func:`pretrained_source`) with ``model_init_kwargs``
    applied as ``from_pretrained`` applies them; for a preset or config dict it is the config ``build_causal_lm``
    uses, special token ids taken from ``tokenizer`` unless overridden.

    The vocabulary is part of a preset's shape: Qwen3-4B's LM head has 151,936 rows whatever tokenizer the run
    reads, and its logits are the largest activation of a long row, so a preset keeps its vocabulary (a plan or
    a memory test of the named model with a smaller one would be of another model). ``config_overrides`` may
    set ``vocab_size``; a config dict that names none takes the tokenizer's length. The tokenizer must fit
    inside the vocabulary (real models pad theirs past their tokenizer's length, so a smaller one is fine).

    Raises:
        ValueError: ``tokenizer`` has more tokens than the model's vocabulary (some ids would index past its
            embedding), with both sizes and the override that fixes it.
    """
    if recipe.model:
        source, init_kwargs = pretrained_source(recipe)
        if not local_files_only:
            require_hub(source, "model")
        return AutoConfig.from_pretrained(
            source, trust_remote_code=recipe.trust_remote_code, local_files_only=local_files_only, **init_kwargs
        )
    shape = PRESETS[recipe.preset] if recipe.preset else recipe.config
    overrides = dict(recipe.config_overrides or {})
    if tokenizer is not None:
        if "vocab_size" not in shape and "vocab_size" not in recipe.model_init_kwargs:
            overrides.setdefault("vocab_size", len(tokenizer))
        for name in ("pad_token_id", "eos_token_id", "bos_token_id"):
            overrides.setdefault(name, getattr(tokenizer, name))
    overrides.update(recipe.model_init_kwargs)
    config = build_config(recipe.preset or recipe.config, overrides)
    if tokenizer is not None and len(tokenizer) > config.vocab_size:
        if "vocab_size" in overrides:
            source = "config_overrides.vocab_size"
        else:
            source = f"the vocabulary of preset {recipe.preset!r}" if recipe.preset else "the config's vocab_size"
        raise ValueError(
            f"The tokenizer has {len(tokenizer):,} tokens but the model's embedding has only {config.vocab_size:,} "
            f"rows ({source}), so some token ids would index past it. Use the tokenizer of the model you mean to "
            f"train, or set config_overrides.vocab_size to at least {len(tokenizer):,}."
        )
    return config


def build_causal_lm_skeleton(recipe: ModelRecipe, tokenizer: PreTrainedTokenizerBase | None = None) -> PreTrainedModel:
    """The model :func:`build_causal_lm` would build, on the meta device: structure, dtypes, no weights.

    A hub or local model is built from its config (``from_pretrained`` refuses the meta device and would read
    the weights), with ``model_init_kwargs`` applied to the config as ``from_pretrained`` applies them.
    """
    if not recipe.model:
        with torch.device("meta"):
            return build_causal_lm(recipe, tokenizer)
    _check_rope_parameters(recipe)
    config = config_for_task(causal_lm_config(recipe), recipe)
    dtype = DTYPES.get(recipe.dtype) or _config_dtype(config)
    with torch.device("meta"):
        return auto_model_class(recipe).from_config(
            config,
            dtype=dtype,
            attn_implementation=recipe.attn_implementation,
            trust_remote_code=recipe.trust_remote_code,
        )


def _config_dtype(config: Any) -> torch.dtype:
    dtype = getattr(config, "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    return dtype or torch.float32


def check_tokenizer_fits_model(
    model: nn.Module, tokenizer: PreTrainedTokenizerBase, tokenizer_name: str, recipe: ModelRecipe
) -> None:
    """Refuse a tokenizer whose ids would index past the model's embedding, or the demo tokenizer on a real model.

    A model trained with the embedded demo tokenizer from a preset keeps the preset's vocabulary (512 rows for the
    tiny presets, more than the tokenizer's length), so the rows alone cannot tell it from a real model: its
    export holds the tokenizer it was trained with, and that is what is compared.
    """
    from lit_memtrain.datamodules.embedded import EMBEDDED

    rows = model.get_input_embeddings().num_embeddings
    if (
        recipe.model
        and tokenizer_name == EMBEDDED
        and rows != len(tokenizer)
        and not _holds_tokenizer(recipe.model, tokenizer)
    ):
        raise ValueError(
            f"model={recipe.model!r} ({rows} embedding rows) is paired with the embedded demo tokenizer "
            f"({len(tokenizer)} tokens), which it was not trained with (its directory does not hold that "
            f"tokenizer, as an export of a run that read it does). Give the model's own tokenizer (for example "
            f"--data.tokenizer={recipe.model})."
        )
    if len(tokenizer) > rows:
        raise ValueError(
            f"Tokenizer {tokenizer_name!r} has {len(tokenizer)} tokens but the model's embedding has "
            f"only {rows} rows, so some token ids would index past it. Use the model's own tokenizer, or a "
            "vocab_size of at least the tokenizer's length."
        )


def _holds_tokenizer(directory: str, tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the local model ``directory`` holds a tokenizer with the same vocabulary as ``tokenizer``."""
    if not (Path(directory) / "tokenizer_config.json").is_file():
        return False
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory).get_vocab() == tokenizer.get_vocab()


def build_training_model(
    recipe: ModelRecipe,
    tokenizer: PreTrainedTokenizerBase | None = None,
    tokenizer_name: str | None = None,
    choose_attention: Callable[[PreTrainedModel], str] | None = None,
    meta: bool = False,
) -> tuple[nn.Module, ModelRecipe]:
    """The model a run trains, in training mode, and the recipe that rebuilds it.

    Built by :func:`build_causal_lm` where the caller's device context puts it (on the meta device with ``meta``,
    :func:`build_causal_lm_skeleton`). Where the recipe names no attention implementation, the model switches to
    ``choose_attention(model)``'s (the caller's choice for its training device), and the recipe returned names it,
    so that an export rebuilds the same model. ``tokenizer`` (called ``tokenizer_name`` in errors) is checked
    against the embedding (:func:`check_tokenizer_fits_model`), and ``recipe.lora`` applied. Returned in training
    mode: ``from_pretrained`` returns eval mode, which Lightning would keep through fit.
    """
    model = (build_causal_lm_skeleton if meta else build_causal_lm)(recipe, tokenizer)
    if recipe.attn_implementation is None and choose_attention is not None:
        name = choose_attention(model)
        if name != model.config._attn_implementation:
            model.set_attn_implementation(name)
        recipe = replace(recipe, attn_implementation=name)
    if tokenizer is not None:
        check_tokenizer_fits_model(model, tokenizer, tokenizer_name, recipe)
    if recipe.task == "reward":
        set_score_padding(model, tokenizer)
    if recipe.lora is not None:
        model = apply_lora(model, recipe.lora, peft_task_type(recipe))
    return model.train(), recipe


def build_sharded_training_model(
    recipe: ModelRecipe,
    parallelize: Callable[[nn.Module], nn.Module],
    parameter_device: torch.device,
    root_device: torch.device,
    global_rank: int,
    tokenizer: PreTrainedTokenizerBase | None = None,
    tokenizer_name: str | None = None,
    choose_attention: Callable[[PreTrainedModel], str] | None = None,
    model: nn.Module | None = None,
) -> tuple[nn.Module, ModelRecipe]:
    """:func:`build_training_model`'s model sharded as it is built, and the recipe that rebuilds it.

    Global rank 0 builds the full model in host memory, the other ranks on the meta device; every rank then
    shards it with ``parallelize`` (a strategy's, e.g. ``FSDP2Strategy.parallelize``) and receives its shards of
    rank 0's weights (:func:`load_sharded`: parameters on ``parameter_device``, the host under CPU offload,
    buffers on ``root_device``). A ``model`` built before (unsharded, rank 0's copy being the source) is sharded
    the same way.

    Raises:
        ValueError: a QLoRA recipe, whose 4/8-bit weights cannot be sharded.
    """
    if recipe.quantized:
        raise ValueError(
            "QLoRA (lora.quantize) is not supported with FSDP2Strategy: its 4/8-bit weights cannot be sharded "
            "by FSDP2. Train a plain LoRA adapter (drop lora.quantize) or QLoRA on one GPU without the strategy."
        )
    if model is None and global_rank == 0:
        with torch.device("cpu"):
            model, recipe = build_training_model(recipe, tokenizer, tokenizer_name, choose_attention)
    elif model is None:
        model, recipe = build_training_model(recipe, tokenizer, tokenizer_name, choose_attention, meta=True)
    return load_sharded(model, parallelize, parameter_device, root_device), recipe


def reload_unquantized_base(recipe: ModelRecipe) -> PreTrainedModel:
    """The base of a QLoRA run reloaded in host memory, unquantized, with everything else it was built with:
    ``model_init_kwargs`` (YaRN ``rope_parameters``...), ``trust_remote_code`` and ``dtype`` (the one its
    unquantized weights had)."""
    init_kwargs = {k: v for k, v in recipe.model_init_kwargs.items() if k not in ("quantization_config", "device_map")}
    dtype = "auto" if recipe.dtype == "auto" else DTYPES[recipe.dtype]
    return auto_model_class(recipe).from_pretrained(
        recipe.model, dtype=dtype, trust_remote_code=recipe.trust_remote_code, device_map={"": "cpu"},
        **_task_kwargs(recipe), **init_kwargs,
    )  # fmt: skip


def export_hf_directory(
    model: nn.Module, recipe: ModelRecipe, directory: str | Path, tokenizer: PreTrainedTokenizerBase | None = None
) -> Path:
    """Write a Hugging Face directory (model with any adapter merged, and tokenizer) that ``from_pretrained`` loads.

    The config written is the trained model's, so constructor options (``model_init_kwargs`` such as YaRN) are
    kept. A LoRA adapter is merged in host memory (:func:`~lit_memtrain.models.lora.merged_copy`); a QLoRA adapter
    into the base reloaded unquantized (:func:`reload_unquantized_base`) rather than into its 4/8-bit weights.
    """
    base = reload_unquantized_base(recipe) if recipe.quantized else None

    def write(folder: Path) -> None:
        merged_copy(model, base).save_pretrained(folder)
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)

    return write_folder(directory, write)  # a failed export leaves no folder that looks complete


def _structure(model: nn.Module) -> list[tuple[str, tuple[int, ...], str]]:
    tensors = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    return [(name, tuple(t.shape), str(t.dtype)) for name, t in tensors]


def _check_same_structure(model: nn.Module) -> None:
    """Refuse to load rank 0's weights into a model whose names, shapes or dtypes differ on this rank."""
    import torch.distributed as dist

    mine = _structure(model)
    source = [mine]
    dist.broadcast_object_list(source, src=0)
    if source[0] != mine:
        differing = [entry for entry in source[0] if entry not in mine] + [e for e in mine if e not in source[0]]
        raise RuntimeError(
            f"Rank {dist.get_rank()} built a model that differs from rank 0's ({len(differing)} differing tensors, "
            f"e.g. {differing[:3]}), so rank 0's weights cannot be loaded into it. Every rank must build the same "
            "model: check that the model, config overrides, dtype and LoRA settings do not depend on the rank."
        )


def _move_to_meta(model: nn.Module) -> None:
    """Replace every parameter and buffer by a meta tensor, keeping shared (tied) parameters shared.

    ``model.to("meta")`` would not: moving across devices makes a new parameter per module that holds it.
    """
    originals, replaced = [], {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is None:
                continue
            if id(param) not in replaced:
                originals.append(param)  # keeps the id from being reused while the loop runs
                replaced[id(param)] = nn.Parameter(torch.empty_like(param, device="meta"), param.requires_grad)
            module._parameters[name] = replaced[id(param)]
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = torch.empty_like(buffer, device="meta")


def _share_parameters_as_in(model: nn.Module, copy: nn.Module) -> None:
    """Tie the parameters of ``copy`` that are one parameter in ``model`` (``load_state_dict(assign=True)`` unties)."""
    holders: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        holders.setdefault(id(param), []).append(name)
    for first, *others in holders.values():
        shared = copy.get_parameter(first)
        for name in others:
            owner_name, _, leaf = name.rpartition(".")
            copy.get_submodule(owner_name)._parameters[leaf] = shared


def _set_tensor(module: nn.Module, name: str, value: torch.Tensor) -> None:
    owner_name, _, leaf = name.rpartition(".")
    owner = module.get_submodule(owner_name)
    owner._buffers[leaf] = value


@torch.no_grad()
def load_sharded(
    model: nn.Module,
    parallelize: Callable[[nn.Module], nn.Module],
    parameter_device: torch.device,
    buffer_device: torch.device,
) -> nn.Module:
    """Shard ``model`` and give every rank its shards of global rank 0's weights, one tensor at a time.

    Rank 0 passes the full model in host memory (loaded or initialised as on one device); the other ranks
    pass the same model on the meta device (:func:`build_causal_lm_skeleton`). Every rank moves it to the
    meta device, shards it with ``parallelize`` (e.g. :meth:`FSDP2Strategy.parallelize`), allocates its
    shards on ``parameter_device`` (the host with CPU offload), and receives each tensor from rank 0 (a
    broadcast of one full tensor, of which each rank keeps its shard). No device ever holds the full model;
    the full weights exist once, in rank 0's host memory, until this returns. Buffers (RoPE frequencies,
    also the non-persistent ones) are broadcast to ``buffer_device``.

    Raises:
        RuntimeError: a rank built a model whose names, shapes or dtypes differ from rank 0's.
    """
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    _check_same_structure(model)
    is_source = dist.get_rank() == 0
    weights = dict(model.state_dict()) if is_source else {}
    buffers = dict(model.named_buffers()) if is_source else {}
    _move_to_meta(model)
    model = parallelize(model)
    model.to_empty(device=parameter_device)
    set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    for name, buffer in list(model.named_buffers()):
        value = buffers[name].to(buffer_device) if is_source else torch.empty_like(buffer, device=buffer_device)
        dist.broadcast(value, src=0)
        _set_tensor(model, name, value)
    return model


def export_sharded_hf_directory(
    model: nn.Module, recipe: ModelRecipe, directory: str | Path, tokenizer: PreTrainedTokenizerBase | None = None
) -> Path | None:
    """Gather a sharded (FSDP2) model into rank 0's host memory and write it there as a Hugging Face directory.

    Collective: every rank must call it. Parameters are gathered one at a time (a full tensor on the
    device, then to the host), so no device holds the whole model; rank 0 rebuilds the model on the meta
    device, takes the gathered tensors as its weights and writes it with :func:`export_hf_directory` (any
    LoRA adapter merged). Returns the directory on rank 0 and ``None`` elsewhere.
    """
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    path = None
    if dist.get_rank() == 0:
        host = build_causal_lm_skeleton(recipe, tokenizer)
        if is_peft_model(model):
            host = apply_lora(host, recipe.lora, peft_task_type(recipe))
        if recipe.task == "reward":
            set_score_padding(host, tokenizer)
        host.load_state_dict(weights, assign=True)
        _share_parameters_as_in(model, host)
        for name, buffer in model.named_buffers():
            _set_tensor(host, name, buffer.detach().to("cpu"))
        path = export_hf_directory(host, recipe, directory, tokenizer)
    dist.barrier()
    return path
