"""CausalLMModule: a Hugging Face causal LM trained with Lightning, with a chunked loss by default.

Why the loss is computed here and not by the model: ``model(..., labels=...)`` materialises the
``[tokens, vocab]`` logits, the first memory wall at long context. With ``loss_type="chunked"`` the module
runs the decoder body and hands the final hidden states and the LM-head weight to
:func:`lit_memtrain.techniques.loss.chunked_cross_entropy`, which never holds the full logits.

The model is always called with ``use_cache=False``; padding-free batches carry ``position_ids`` and no
attention mask, which is how transformers keeps packed documents from attending to each other.
"""

from __future__ import annotations


import importlib.util
import math
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor, nn
from torchmetrics import MeanMetric
from transformers import PreTrainedModel

from lit_memtrain.techniques.attention import SDPA_BY_DOCUMENT, VARLEN_BY_DOCUMENT, choose_document_attention
from lit_memtrain.parallel.context_parallel import ATTENTION_NAMES as CONTEXT_PARALLEL_ATTENTION
from lit_memtrain.models.lora import LoraSettings, apply_lora, head_weight
from lit_memtrain.techniques.loss import chunked_cross_entropy, cross_entropy, transform_logits
from lit_memtrain.datamodules.batch import IGNORE_INDEX, batch_targets
from lit_memtrain.models.builder import (
    ModelRecipe,
    build_causal_lm,
    build_causal_lm_skeleton,
    check_tokenizer_fits_model,
    export_hf_directory,
    export_sharded_hf_directory,
    load_sharded,
)
from lit_memtrain.models.moe import load_balancing_loss, router_aux_coefficient
from lit_memtrain.objectives.checkpoint_io import lit_memtrain_class_path
from lit_memtrain.objectives.optim import instantiate
from lit_memtrain.objectives.probes import LogitTransform, probe_document_isolation, probe_logit_transform
from lit_memtrain.objectives.step_tokens import STEP_TRAINABLE_TOKENS, count_step_tokens_during_fit
from lit_memtrain.strategies.fsdp2 import FSDP2Strategy
from lit_memtrain.parallel.fsdp import is_sharded, run_inside_forward
from lit_memtrain.objectives.throughput import attention_pairs, count_tokens, peak_flops, training_flops

_BATCH_ONLY_KEYS = (
    "labels", "shift_labels", "num_trainable_tokens", "num_tokens", "seq_lengths", "attention_pairs",
    STEP_TRAINABLE_TOKENS,
)  # fmt: skip
_VARLEN_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
# Attention implementations whose padding-free rows equal per-document runs in this project's tests
# (tests/objectives/test_causal_lm_padding_free.py, tests/techniques/test_attention.py); any other is probed once at setup.
# Context-parallel attention keeps documents apart by the row's bounds (tests/parallel/context_parallel).
_PROVEN_DOCUMENT_ATTENTION = frozenset({"eager", "sdpa", SDPA_BY_DOCUMENT, *CONTEXT_PARALLEL_ATTENTION.values()})


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _plain_spec(spec: Any) -> dict[str, Any] | None:
    """A ``{"class_path", "init_args"}`` spec (dict or jsonargparse namespace) as nested plain dicts."""
    if spec is None:
        return None
    as_dict = spec.as_dict() if hasattr(spec, "as_dict") else dict(spec)
    return {"class_path": as_dict["class_path"], "init_args": dict(as_dict.get("init_args") or {})}


def _is_padding_free(batch: dict[str, Any]) -> bool:
    return "position_ids" in batch and "attention_mask" not in batch


def _check_attn_implementation(name: str | None) -> None:
    if name is not None and name.startswith("flash_attention") and importlib.util.find_spec("flash_attn") is None:
        raise ValueError(
            f"attn_implementation={name!r} needs the flash-attn package, which is not installed. "
            "Install it with: pip install 'lit-memtrain[flash]' (CUDA only), or use 'sdpa'."
        )


def _fused_adamw_supported(params: list[Tensor]) -> bool:
    """The fused AdamW kernel (one kernel for all parameters, ~3x faster than the per-tensor loop) runs on
    plain tensors of these device types; sharded DTensor parameters keep the default implementation."""
    from torch.distributed.tensor import DTensor

    return bool(params) and all(
        p.device.type in ("cpu", "cuda", "xpu", "mps") and p.is_floating_point() and not isinstance(p, DTensor)
        for p in params
    )


class CausalLMModule(LightningModule):
    """Fine-tune a causal LM from the hub, a local directory, or random weights from a preset/config.

    Args:
        model: hub id or local path passed to ``AutoModelForCausalLM.from_pretrained``.
        preset: a preset name from :data:`lit_memtrain.models.presets.PRESETS` (random weights), used when
            ``model`` is not given; ``config`` may be a dict with ``model_type`` instead.
        config_overrides: config values applied on top of the preset (for example ``num_hidden_layers``).
        tokenizer: tokenizer to export with the model (linked to the datamodule's by the CLI). A model built
            from a preset takes its vocabulary size from it unless ``config_overrides`` sets ``vocab_size``.
        dtype: parameter dtype: ``float32``, ``bfloat16``, ``float16`` or ``auto`` (the checkpoint's).
        attn_implementation: ``sdpa``, ``eager``, ``flex_attention``, ``flash_attention_2``, a hub kernel
            name such as ``kernels-community/flash-attn``, ``sdpa_by_document`` (SDPA once per packed
            document, without the dense L x L mask ``sdpa`` builds for padding-free rows) or
            ``varlen_by_document`` (one torch ``varlen_attn`` kernel per packed row on CUDA); see
            :mod:`lit_memtrain.techniques.attention`. ``None`` (the default) picks, once and logged, the fastest one that
            keeps packed documents apart on the training device
            (:func:`~lit_memtrain.techniques.attention.choose_document_attention`): ``sdpa_by_document`` on CPU,
            flash-attn or ``varlen_by_document`` on CUDA; on unpacked batches each behaves as ``sdpa``.
        model_init_kwargs: extra arguments for the model constructor, e.g. YaRN
            ``{"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
            "original_max_position_embeddings": 40960}}``.
        loss_type: ``chunked`` (never materialises the logits) or ``nll`` (plain logits + cross-entropy).
        loss_chunk_size: rows per chunk of the chunked loss.
        router_aux_loss_coef: weight of a mixture-of-experts model's router load-balancing loss in the training
            loss; ``None`` takes the model config's ``router_aux_loss_coef``, 0 turns it off.
        learning_rate, weight_decay, betas: AdamW settings; no decay on biases and norm weights.
        warmup: warmup steps (int) or fraction of the total steps (float < 1), then cosine decay
            to ``min_lr_ratio * learning_rate``.
        optimizer: another optimizer, as ``{"class_path": "torch.optim.SGD", "init_args": {"lr": 0.1}}`` (any
            ``torch.optim`` class, or :mod:`lit_memtrain.objectives.optim`'s 8-bit / paged AdamW); its own init args apply
            (``learning_rate``, ``weight_decay`` and ``betas`` are the default AdamW's), biases and norm weights
            still get no weight decay. ``lit-memtrain fit`` links ``--optimizer`` here.
        lr_scheduler: another schedule, as ``{"class_path": ..., "init_args": {...}}``, stepped every optimizer
            step, in place of warmup-cosine. ``lit-memtrain fit`` links ``--lr_scheduler`` here.

        lora: train a LoRA adapter instead of all weights (:class:`~lit_memtrain.models.lora.LoraSettings`);
            with ``quantize`` the base is loaded in 4 or 8 bits (QLoRA, CUDA only). When the base comes from
            ``model``, checkpoints hold only the adapter.
        export_dir: at the end of fit, write a Hugging Face directory (model + tokenizer, adapter merged) here.
        trust_remote_code: passed to ``from_pretrained`` / ``from_config``.

    Logged while training: ``train/loss`` and ``train/ppl`` (each micro-batch's), ``train/tokens`` (real tokens
    trained so far over all ranks, each token once: a context-parallel group's shards add up to its rows), and
    every ``log_every_n_steps`` optimizer steps (the only device sync for it; no ``.item()`` per micro-batch)
    ``train/tokens_per_sec`` (the same count, all ranks), ``train/device/tokens_per_sec``,
    ``train/device/flops_per_sec`` and, on accelerators in Lightning's table of peak FLOP/s (not on CPU),
    ``train/device/mfu`` (model FLOPs utilisation: :mod:`lit_memtrain.objectives.throughput`). The line printed at the end
    of fit reports the same token count.

    Loss normalisation: every optimizer step trains on the mean loss of all its trainable target tokens,
    across gradient-accumulation micro-batches and data-parallel ranks, so each token weighs the same however
    the tokens fall into micro-batches (``train/loss`` shows each micro-batch's own mean). The step's count
    is known before its first backward (:mod:`lit_memtrain.objectives.step_tokens`), so every gradient (clipping,
    callbacks, GradScaler) is the gradient of that mean.

    The model is built in :meth:`configure_model`, which Lightning calls inside the strategy's device context
    (directly on the training device); outside a ``Trainer``, call ``module.configure_model()`` first. Under
    :class:`~lit_memtrain.strategies.FSDP2Strategy` it is sharded as it is built: see :meth:`configure_model`.

    Setup probes (:mod:`lit_memtrain.objectives.probes`), a few tokens without gradients, run once: in a ``Trainer`` from
    ``on_fit_start`` / ``on_validation_start`` (the logit probe) and at the first padding-free batch
    (``on_train_batch_start`` / ``on_validation_batch_start``, the document probe); called directly, from the
    first :meth:`compute_loss` or :meth:`token_losses`. The chunked loss applies the logit scale and cap the
    model applies after its LM head, or refuses a model it cannot reproduce (naming ``loss_type="nll"``);
    padding-free batches with an attention implementation not proven by this project's tests must keep two
    packed documents apart, or the run stops with an error.

    Example:
        >>> module = CausalLMModule(preset="tiny-qwen3", tokenizer="lit-memtrain/embedded")
        >>> trainer = Trainer(max_steps=20)  # doctest: +SKIP
        >>> trainer.fit(module, datamodule=SFTDataModule(max_length=64))  # doctest: +SKIP
    """

    def __init__(
        self,
        model: str | None = None,
        preset: str | None = None,
        config: dict[str, Any] | None = None,
        config_overrides: dict[str, Any] | None = None,
        tokenizer: str | None = None,
        dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32",
        attn_implementation: str | None = None,
        model_init_kwargs: dict[str, Any] | None = None,
        loss_type: Literal["chunked", "nll"] = "chunked",
        loss_chunk_size: int = 1024,
        router_aux_loss_coef: float | None = None,
        learning_rate: float = 2e-5,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        warmup: float = 0.03,
        min_lr_ratio: float = 0.1,
        optimizer: dict[str, Any] | None = None,
        lr_scheduler: dict[str, Any] | None = None,
        lora: LoraSettings | None = None,
        export_dir: str | None = None,
        trust_remote_code: bool = False,
    ) -> None:
        super().__init__()
        if isinstance(lora, dict):  # hyper-parameters saved by LightningCLI or a checkpoint hold plain dicts
            lora = LoraSettings(**lora)
        self.recipe = ModelRecipe(
            model=model,
            preset=preset,
            config=config,
            config_overrides=config_overrides,
            dtype=dtype,
            attn_implementation=attn_implementation,
            model_init_kwargs=dict(model_init_kwargs or {}),
            trust_remote_code=trust_remote_code,
            lora=lora,
        )
        if loss_type not in ("chunked", "nll"):
            raise ValueError(f"loss_type must be 'chunked' or 'nll', got {loss_type!r}.")
        if loss_chunk_size < 1:
            raise ValueError(f"loss_chunk_size must be a positive number of rows, got {loss_chunk_size}.")
        if router_aux_loss_coef is not None and router_aux_loss_coef < 0:
            raise ValueError(f"router_aux_loss_coef must be >= 0 (0 turns it off), got {router_aux_loss_coef}.")
        if warmup < 0 or not 0 <= min_lr_ratio <= 1:
            raise ValueError(f"warmup must be >= 0 and min_lr_ratio in [0, 1]; got {warmup} and {min_lr_ratio}.")
        _check_attn_implementation(attn_implementation)
        # LightningCLI links --optimizer / --lr_scheduler as namespaces: keep plain dicts in the hyper-parameters.
        optimizer, lr_scheduler = _plain_spec(optimizer), _plain_spec(lr_scheduler)
        self.lora = lora
        self.save_hyperparameters()
        from lit_memtrain.datamodules.tokenizer import load_tokenizer

        self.tokenizer = load_tokenizer(tokenizer) if tokenizer else None
        self.model: PreTrainedModel | None = None
        self.adapter_only_checkpoints = lora is not None and bool(model)
        self.strict_loading = not self.adapter_only_checkpoints
        self._tokens_seen: int | Tensor = 0
        self._restore_dataloader_processing: Callable[[], None] | None = None
        self._first_loss: Tensor | None = None
        self._last_loss: Tensor | None = None
        self._window_started_at = 0.0
        self._window_tokens: int | Tensor = 0
        self._window_pairs: int | Tensor = 0
        self._window_seen_from: int | Tensor = 0
        self._measured_at_step = 0
        self._throughput: dict[str, float] = {}
        self._logit_transform: LogitTransform | None = None
        self._isolation_proven_for: str | None = None
        self.val_token_nll = MeanMetric()
        self.val_token_accuracy = MeanMetric()

    def configure_model(self) -> None:
        """Build the model (and its LoRA adapter) once; Lightning calls this inside the strategy's device context.

        Outside a ``Trainer`` (a notebook, a test), call it yourself before using ``module.model``.

        Under :class:`~lit_memtrain.strategies.FSDP2Strategy` the model is built sharded: global rank 0 loads
        (or initialises) the full model in host memory, the other ranks build it on the meta device; every
        rank shards it (:meth:`FSDP2Strategy.parallelize`: each decoder layer, then the root) and receives its
        shards from rank 0 one tensor at a time (:func:`~lit_memtrain.models.builder.load_sharded`), so no
        device ever holds the whole model. A model built before the fit (``configure_model()`` called
        outside the Trainer) is sharded the same way, rank 0's copy being the source.
        """
        strategy = self._trainer.strategy if self._trainer is not None else None
        if isinstance(strategy, FSDP2Strategy):
            if not is_sharded(self.model):
                self.model = self._build_sharded_model(strategy)
            return
        if isinstance(strategy, ModelParallelStrategy):
            raise TypeError(
                f"CausalLMModule does not parallelise itself under {type(strategy).__name__}; use "
                "lit_memtrain.strategies.FSDP2Strategy (sharded data parallelism, with host offload if needed)."
            )
        if self.model is not None:
            return
        self.model = self._build_model(build_causal_lm)

    def _build_model(self, build: Callable[[ModelRecipe, Any], nn.Module]) -> nn.Module:
        model = build(self.recipe, self.tokenizer)
        if self.recipe.attn_implementation is None:
            self._choose_attention(model)
        if self.tokenizer is not None:
            check_tokenizer_fits_model(model, self.tokenizer, self.hparams.tokenizer, self.recipe)
        if self.lora is not None:
            model = apply_lora(model, self.lora)
        return model.train()  # from_pretrained returns eval mode, which Lightning would keep through fit

    def _build_sharded_model(self, strategy: FSDP2Strategy) -> nn.Module:
        if self.recipe.quantized:
            raise ValueError(
                "QLoRA (lora.quantize) is not supported with FSDP2Strategy: its 4/8-bit weights cannot be sharded "
                "by FSDP2. Train a plain LoRA adapter (drop lora.quantize) or QLoRA on one GPU without the strategy."
            )
        model = self.model
        if model is None and strategy.global_rank == 0:
            with torch.device("cpu"):
                model = self._build_model(build_causal_lm)
        elif model is None:
            model = self._build_model(build_causal_lm_skeleton)
        return load_sharded(model, strategy.parallelize, strategy.parameter_device, strategy.root_device)

    def _choose_attention(self, model: PreTrainedModel) -> None:
        """Switch a model built with transformers' default attention to the fastest one that keeps packed
        documents apart on the training device, and say which."""
        device = self._trainer.strategy.root_device if self._trainer is not None else model.device
        precision = str(self._trainer.precision) if self._trainer is not None else ""
        half_precision = model.dtype in (torch.float16, torch.bfloat16) or precision.startswith(("bf16", "16"))
        name = choose_document_attention(model, device, half_precision)
        if name != model.config._attn_implementation:
            model.set_attn_implementation(name)
        self.recipe = replace(self.recipe, attn_implementation=name)
        rank_zero_info(f"attn_implementation: {name!r}, the fastest that keeps packed documents apart on {device.type}")

    def _model_inputs(self, batch: dict[str, Any]) -> dict[str, Any]:
        inputs = {k: v for k, v in batch.items() if k not in _BATCH_ONLY_KEYS and k not in _VARLEN_KEYS}
        if _is_padding_free(batch):
            name = self.model.config._attn_implementation
            if "flash" in name:
                inputs.update({k: batch[k] for k in _VARLEN_KEYS if k in batch})
            elif name in (SDPA_BY_DOCUMENT, VARLEN_BY_DOCUMENT) and "cu_seq_lens_q" in batch:  # read once, not per layer
                inputs["cu_seq_lens_q"] = batch["cu_seq_lens_q"].cpu()
        inputs["use_cache"] = False
        return inputs

    def run_setup_probes(self, batch: dict[str, Any] | None = None) -> None:
        """Run, once each, the probes this module's loss and ``batch`` need (see the class docstring).

        Padding-free rows rely on the attention implementation splitting documents at position restarts;
        transformers' eager and sdpa and our ``sdpa_by_document`` are proven to by tests, any other (a new
        kernel, a registered function, a ``trust_remote_code`` model building its own mask) is probed.
        """
        if self.hparams.loss_type == "chunked" and self._logit_transform is None:
            self._logit_transform = probe_logit_transform(self.model)
            if self._logit_transform != LogitTransform():
                rank_zero_info(f"chunked loss: applying the model's logit transform {self._logit_transform}")
        if batch is None or not _is_padding_free(batch):
            return
        name = self.model.config._attn_implementation
        if name in _PROVEN_DOCUMENT_ATTENTION or name == self._isolation_proven_for:
            return
        probe_document_isolation(self.model, self._model_inputs, name)
        rank_zero_info(f"attn_implementation={name!r} keeps packed documents apart (probed at setup)")
        self._isolation_proven_for = name

    def on_fit_start(self) -> None:
        self.run_setup_probes()

    def on_validation_start(self) -> None:
        self.run_setup_probes()

    def on_validation_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self.run_setup_probes(batch)

    def _lm_head_weight(self) -> tuple[Tensor, Tensor | None]:
        return head_weight(self.model.get_output_embeddings())

    def _in_root_forward(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` where the model's root parameters are usable.

        Under FSDP2 the embeddings and LM head are gathered only inside the root module's forward, and the
        chunked loss reads the head's weight and calls the decoder directly: run it as the root's forward
        (the head is then gathered once per step, not once per chunk).
        """
        if is_sharded(self.model):
            return run_inside_forward(self.model, fn, *args)
        return fn(*args)

    def _hidden_and_head(
        self, batch: dict[str, Any], output_router_logits: bool = False
    ) -> tuple[Tensor, Tensor, Tensor | None, tuple[Tensor, ...] | None]:
        """Final hidden states [N, H], the LM head's weight and bias, and the router logits when asked for."""
        decoder = self.model.get_decoder()
        inputs = self._model_inputs(batch)
        if output_router_logits:
            inputs["output_router_logits"] = True
        outputs = decoder(**inputs)
        hidden = outputs.last_hidden_state
        weight, bias = self._lm_head_weight()
        # A LoRA head keeps fp32 adapters on a bf16 base: compute the loss in the hidden states' dtype.
        bias = bias.to(hidden.dtype) if bias is not None else None
        router_logits = getattr(outputs, "router_logits", None) if output_router_logits else None
        return hidden.flatten(0, 1), weight.to(hidden.dtype), bias, router_logits

    def router_aux_weight(self) -> float:
        """Weight of the router load-balancing loss: ``router_aux_loss_coef``, else the model config's; 0 for a
        model without routers."""
        return router_aux_coefficient(self.model, self.hparams.router_aux_loss_coef)

    def compute_loss(self, batch: dict[str, Any], num_items: int | Tensor | None = None) -> Tensor:
        """Mean cross-entropy over the batch's trainable target tokens (or divided by ``num_items``), plus the
        router load-balancing loss of a mixture-of-experts model.

        The load-balancing loss is the model's own (``router_aux_weight() * aux``), weighted by this
        batch's share of the ``num_items`` trainable tokens, like its cross-entropy terms: with ``num_items``
        left out the result is the model's own loss; summed over the micro-batches of a step it is the mean
        cross-entropy plus the token-weighted mean of the micro-batches' load-balancing losses.
        """
        self.run_setup_probes(batch)
        targets = batch_targets(batch).flatten()
        coefficient = self.router_aux_weight()
        if self.hparams.loss_type == "nll":
            inputs = self._model_inputs(batch)
            if coefficient:
                inputs["output_router_logits"] = True
            outputs = self.model(**inputs)
            loss = cross_entropy(outputs.logits.flatten(0, 1), targets, num_items)
            aux = getattr(outputs, "aux_loss", None) if coefficient else None
        else:
            loss, aux = self._in_root_forward(self._chunked_loss, batch, targets, num_items, coefficient)
        if not coefficient:
            return loss
        if aux is None:
            raise ValueError(
                f"{type(self.model).__name__} has routers but returned no aux_loss with output_router_logits=True; "
                "set router_aux_loss_coef=0 to train without the load-balancing loss."
            )
        trainable = (targets != IGNORE_INDEX).sum()
        share = trainable / (trainable if num_items is None else torch.as_tensor(num_items, device=trainable.device)).clamp(min=1)
        return loss + coefficient * aux.to(loss.device) * share

    def _chunked_loss(
        self, batch: dict[str, Any], targets: Tensor, num_items: int | Tensor | None, coefficient: float
    ) -> tuple[Tensor, Tensor | None]:
        """The chunked cross-entropy and, with a non-zero ``coefficient``, the router load-balancing loss."""
        hidden, weight, bias, router_logits = self._hidden_and_head(batch, output_router_logits=bool(coefficient))
        transform = self._logit_transform
        loss = chunked_cross_entropy(
            hidden, weight, targets, num_items, self.hparams.loss_chunk_size, transform.softcap, bias, transform.scale
        )
        aux = load_balancing_loss(self.model, router_logits, batch.get("attention_mask")) if coefficient else None
        return loss, aux

    @torch.no_grad()
    def token_losses(self, batch: dict[str, Any]) -> tuple[Tensor, Tensor, Tensor]:
        """Per-token loss, correctness of the argmax prediction, and position in document, for trainable targets."""
        self.run_setup_probes(batch)
        if self.hparams.loss_type == "nll":  # calls the model itself
            return self._token_losses(batch)
        return self._in_root_forward(self._token_losses, batch)

    def _token_losses(self, batch: dict[str, Any]) -> tuple[Tensor, Tensor, Tensor]:
        shaped_targets = batch_targets(batch)
        targets = shaped_targets.flatten()
        keep = targets != IGNORE_INDEX
        if "position_ids" in batch:
            positions = batch["position_ids"].expand_as(shaped_targets).flatten()
        else:
            positions = torch.arange(shaped_targets.shape[-1], device=targets.device).expand_as(shaped_targets)
            positions = positions.flatten()
        if self.hparams.loss_type == "nll":
            hidden = self.model(**self._model_inputs(batch)).logits.flatten(0, 1)[keep]
            weight, bias, transform = None, None, LogitTransform()
        else:
            hidden, weight, bias, _ = self._hidden_and_head(batch)
            hidden, transform = hidden[keep], self._logit_transform
        losses, correct = [], []
        for start in range(0, hidden.shape[0], self.hparams.loss_chunk_size):
            rows = hidden[start : start + self.hparams.loss_chunk_size]
            logits = rows.float() if weight is None else F.linear(rows, weight, bias).float()
            logits = transform_logits(logits, transform.softcap, transform.scale)
            chunk_targets = targets[keep][start : start + self.hparams.loss_chunk_size]
            losses.append(F.cross_entropy(logits, chunk_targets, reduction="none"))
            correct.append(logits.argmax(-1) == chunk_targets)
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return (
            torch.cat(losses) if losses else empty,
            torch.cat(correct) if correct else empty.bool(),
            positions[keep] + 1,
        )

    @staticmethod
    def count_tokens(batch: dict[str, Any]) -> int:
        """Real (non-padding) input tokens in a batch (a device sync when they are counted on a device)."""
        return int(count_tokens(batch))

    @staticmethod
    def count_trainable_targets(batch: dict[str, Any]) -> int:
        """Target tokens the loss of ``batch`` sums over (labels after the shift that are not -100)."""
        return int((batch_targets(batch) != IGNORE_INDEX).sum())

    def setup(self, stage: str) -> None:
        if stage == "fit":
            self._restore_dataloader_processing = count_step_tokens_during_fit(
                self.trainer, self.count_trainable_targets
            )

    def teardown(self, stage: str) -> None:
        if self._restore_dataloader_processing is not None:
            self._restore_dataloader_processing()
            self._restore_dataloader_processing = None

    def _step_trainable_tokens(self, batch: dict[str, Any]) -> Tensor:
        """Trainable target tokens of this micro-batch's whole optimizer step, summed over the ranks' rows.

        Summed over the ``data_parallel`` dimension of the strategy's device mesh when it has one (ranks that
        share rows, such as a context-parallel group, count them once), else over all ranks.
        """
        trainer = self.trainer
        if STEP_TRAINABLE_TOKENS in batch:
            tokens = batch[STEP_TRAINABLE_TOKENS]
        elif trainer.accumulate_grad_batches == 1 and trainer.world_size == 1:
            tokens = self.count_trainable_targets(batch)
        else:
            raise RuntimeError(
                f"The batch has no {STEP_TRAINABLE_TOKENS!r}: with gradient accumulation or several ranks the "
                "loss is divided by the trainable tokens of the whole optimizer step, which CausalLMModule.setup "
                "arranges for the training dataloader. Call super().setup(stage) if you override setup."
            )
        tokens = torch.tensor(tokens, device=self.device)
        if trainer.world_size > 1:
            mesh = self.device_mesh
            group = mesh["data_parallel"].get_group() if mesh is not None else None
            tokens = trainer.strategy.reduce(tokens, group=group, reduce_op="sum")
        return tokens

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        # The loss backpropagated is this micro-batch's sum of token losses divided by the trainable tokens of
        # the whole optimizer step (all micro-batches, all ranks), times the factors Lightning (which divides
        # by accumulate_grad_batches) and DDP / FSDP2 (which average gradients over ranks) divide by again.
        scale = self.trainer.accumulate_grad_batches * self.trainer.world_size
        loss_sum = self.compute_loss(batch, num_items=1)
        loss = loss_sum * (scale / self._step_trainable_tokens(batch).clamp(min=1))
        mean = self._micro_batch_mean(loss_sum.detach(), (batch_targets(batch) != IGNORE_INDEX).sum())
        if self._first_loss is None:  # kept on the device: reading it now would wait for the step to finish
            self._first_loss = mean
        self._last_loss = mean
        self.log("train/loss", mean, prog_bar=True)
        self.log("train/ppl", torch.exp(mean.clamp(max=50.0)))
        self.log("train/tokens", self._tokens_seen_metric())
        return loss

    def _tokens_seen_metric(self) -> Tensor:
        """``train/tokens`` as a metric: float64 (exact to 2**53 tokens, where float32 rounds past 2**24, a count
        a multi-rank run passes in minutes) where the device has it; a count kept on the device stays there (no
        sync), one kept in Python becomes a host tensor."""
        seen = self._tokens_seen
        if not isinstance(seen, Tensor):
            return torch.tensor(seen, dtype=torch.float64)
        return seen.to(torch.float32 if seen.device.type == "mps" else torch.float64)

    def _micro_batch_mean(self, loss_sum: Tensor, targets: Tensor) -> Tensor:
        """The micro-batch's mean token loss; over the whole rows when each rank of a context-parallel group
        holds a shard of them (one all-reduce of two numbers over the group)."""
        mesh = self.device_mesh
        split = mesh is not None and "context_parallel" in (mesh.mesh_dim_names or ())
        if split and mesh["context_parallel"].size() > 1:
            totals = torch.stack([loss_sum.float(), targets.float()])
            torch.distributed.all_reduce(totals, group=mesh["context_parallel"].get_group())
            loss_sum, targets = totals[0], totals[1]
        return loss_sum / targets.clamp(min=1)

    @property
    def first_train_loss(self) -> float | None:
        """Mean loss of the first training micro-batch (read from the device when asked for)."""
        return None if self._first_loss is None else float(self._first_loss)

    @first_train_loss.setter
    def first_train_loss(self, value: float | None) -> None:
        self._first_loss = None if value is None else torch.tensor(value)

    @property
    def last_train_loss(self) -> float | None:
        """Mean loss of the latest training micro-batch (read from the device when asked for)."""
        return None if self._last_loss is None else float(self._last_loss)

    @last_train_loss.setter
    def last_train_loss(self, value: float | None) -> None:
        self._last_loss = None if value is None else torch.tensor(value)

    @property
    def train_tokens_seen(self) -> int:
        """Real tokens of all training batches so far, summed over every rank, each token once (the same on every
        rank; read from the device when asked for)."""
        return int(self._tokens_seen)

    @train_tokens_seen.setter
    def train_tokens_seen(self, value: int) -> None:
        self._tokens_seen = value

    def on_train_start(self) -> None:
        _synchronize(self.device)
        self._window_started_at, self._window_tokens, self._window_pairs = time.perf_counter(), 0, 0
        self._window_seen_from = self._tokens_seen
        self._measured_at_step = self.trainer.global_step

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.run_setup_probes(batch)
        tokens = count_tokens(batch)  # device tensors when counted there, read at the next measurement only
        self._tokens_seen = self._tokens_seen + self._summed_over_ranks(tokens)
        self._window_tokens = self._window_tokens + tokens
        self._window_pairs = self._window_pairs + attention_pairs(batch)

    def _summed_over_ranks(self, tokens: int | Tensor) -> int | Tensor:
        """This micro-batch's real tokens over all ranks: each rank counts the tokens it holds (its own rows, or
        its shard of its group's rows under context parallelism), so the sum counts every token once. One
        all-reduce of one number, without the barrier of ``strategy.reduce`` (no wait for the device)."""
        if self.trainer.world_size == 1:
            return tokens
        total = tokens.detach().clone() if isinstance(tokens, Tensor) else torch.tensor(tokens, device=self.device)
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):  # e.g. XLA's own reduce
            return self.trainer.strategy.reduce(total, reduce_op="sum")
        torch.distributed.all_reduce(total)
        return total

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """Measure throughput every ``log_every_n_steps`` optimizer steps (and at the last), the only time the
        device is synchronised for it; log the latest measurement at every batch."""
        step = self.trainer.global_step
        last = 0 < self.trainer.max_steps <= step
        if step != self._measured_at_step and (step % self.trainer.log_every_n_steps == 0 or last):
            self._throughput = self._measure_throughput()
            self._measured_at_step = step
        for name, value in self._throughput.items():
            self.log(name, value, prog_bar=name == "train/tokens_per_sec")

    def _measure_throughput(self) -> dict[str, float]:
        """Tokens/s over all ranks and per device, model FLOP/s per device and, where the device's peak is
        known (not on CPU), model FLOPs utilisation, since the last measurement."""
        _synchronize(self.device)
        now = time.perf_counter()
        elapsed = max(now - self._window_started_at, 1e-9)
        tokens = int(self._window_tokens)
        total = int(self._tokens_seen) - int(self._window_seen_from)  # what train/tokens rose by
        flops_per_sec = training_flops(self.model, tokens, self._window_pairs) / elapsed
        metrics = {
            "train/tokens_per_sec": total / elapsed,
            "train/device/tokens_per_sec": tokens / elapsed,
            "train/device/flops_per_sec": flops_per_sec,
        }
        peak = peak_flops(self.device, self._compute_dtype())
        if peak:
            metrics["train/device/mfu"] = flops_per_sec / peak
        self._window_started_at, self._window_tokens, self._window_pairs = now, 0, 0
        self._window_seen_from = self._tokens_seen
        return metrics

    def _compute_dtype(self) -> torch.dtype:
        precision = str(self.trainer.precision)
        if precision.startswith("bf16"):
            return torch.bfloat16
        if precision.startswith("16"):
            return torch.float16
        return self.model.dtype

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> dict[str, Tensor]:
        losses, correct, positions = self.token_losses(batch)
        if losses.numel():
            self.val_token_nll.update(losses)
            self.val_token_accuracy.update(correct.float())
        return {"loss": losses.mean() if losses.numel() else losses.sum(), "token_losses": losses, "token_positions": positions}

    def on_validation_epoch_end(self) -> None:
        if self.val_token_nll.update_count == 0:
            return
        nll = self.val_token_nll.compute()
        self.log("val/loss", nll, prog_bar=True)
        self.log("val/ppl", torch.exp(nll))
        self.log("val/token_accuracy", self.val_token_accuracy.compute())
        with torch.inference_mode(False):  # states made under inference mode could not be updated under no_grad
            self.val_token_nll.reset()
            self.val_token_accuracy.reset()

    def configure_optimizers(self) -> dict[str, Any]:
        """AdamW (or ``optimizer``) with no weight decay on biases and norm weights, stepped every optimizer
        step by the warmup-cosine schedule (or ``lr_scheduler``)."""
        hp = self.hparams
        trainable = [(n, p) for n, p in self.named_parameters() if p.requires_grad]
        low_precision = [n for n, p in trainable if p.dtype in (torch.bfloat16, torch.float16)]
        if low_precision:
            rank_zero_warn(
                f"{len(low_precision)} trainable parameters are {self.dtype} (e.g. {low_precision[0]}): AdamW updates "
                "them in place in that precision, which rounds away updates smaller than about 1/256 of a weight "
                "(most updates at learning rates below ~1e-4). For full fine-tuning prefer dtype='float32' with "
                "Trainer(precision='bf16-mixed'), or train a LoRA adapter (its weights stay fp32)."
            )
        decay = [p for n, p in trainable if p.ndim >= 2]
        no_decay = [p for n, p in trainable if p.ndim < 2]
        if hp.optimizer:  # its own init args, weight_decay included, apply to the decayed group
            optimizer = instantiate(hp.optimizer, [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}])
        else:
            optimizer = torch.optim.AdamW(
                [{"params": decay, "weight_decay": hp.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
                lr=hp.learning_rate,
                betas=tuple(hp.betas),
                fused=self._fused_adamw_allowed([p for _, p in trainable]),
            )
        if hp.lr_scheduler:
            scheduler = instantiate(hp.lr_scheduler, optimizer)
            config = {"scheduler": scheduler, "interval": "step"}
            if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
                config["monitor"] = getattr(scheduler, "monitor", "train/loss")
            return {"optimizer": optimizer, "lr_scheduler": config}
        total = max(1, int(self.trainer.estimated_stepping_batches))
        warmup = int(hp.warmup * total) if hp.warmup < 1 else int(hp.warmup)

        def lr_factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / (warmup + 1)
            progress = min(1.0, (step - warmup) / max(1, total - warmup))
            return hp.min_lr_ratio + (1 - hp.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def _fused_adamw_allowed(self, params: list[Tensor]) -> bool:
        """Fused AdamW where its kernel runs and Lightning's precision plugin accepts it: an fp16 GradScaler
        (``precision="16-mixed"``) cannot clip the gradients of an optimizer that unscales them itself."""
        if not _fused_adamw_supported(params):
            return False
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)
        clipping = bool(self.trainer.gradient_clip_val)
        return not (scaler is not None and clipping)

    def on_train_end(self) -> None:
        if self.first_train_loss is not None:
            self.print(
                f"train loss: first {self.first_train_loss:.4f} -> last {self.last_train_loss:.4f} "
                f"over {self.trainer.global_step} steps, {self.train_tokens_seen} tokens"
            )

    def on_fit_end(self) -> None:
        # A sharded model is gathered by every rank together; rank 0 writes it.
        if self.hparams.export_dir and (self.trainer.is_global_zero or is_sharded(self.model)):
            path = self.export(self.hparams.export_dir)
            self.print(f"exported Hugging Face model to {path}")

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["lit_memtrain"] = {
            "module_class": lit_memtrain_class_path(type(self)),
            "train_tokens_seen": self.train_tokens_seen,
            "first_train_loss": self.first_train_loss,
            "last_train_loss": self.last_train_loss,
        }
        # A distributed checkpoint of a sharded run keeps every tensor: it is loaded key by key, frozen base included.
        if self.adapter_only_checkpoints and not is_sharded(self.model):
            trainable = {f"model.{name}" for name, p in self.model.named_parameters() if p.requires_grad}
            checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k in trainable}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        counters = checkpoint.get("lit_memtrain", {})
        self.train_tokens_seen = counters.get("train_tokens_seen", 0)
        self.first_train_loss = counters.get("first_train_loss")
        self.last_train_loss = counters.get("last_train_loss")

    def export(self, directory: str | Path) -> Path | None:
        """Write a Hugging Face directory (model with any adapter merged, and tokenizer) that ``from_pretrained`` loads.

        A sharded model is gathered into rank 0's host memory and written there: every rank must call this,
        and ranks other than 0 get ``None``.
        """
        if is_sharded(self.model):
            return export_sharded_hf_directory(self.model, self.recipe, directory, self.tokenizer)
        return export_hf_directory(self.model, self.recipe, directory, self.tokenizer)
