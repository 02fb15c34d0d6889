"""CausalLMModule: a Hugging Face causal LM trained with Lightning, with a chunked loss by default.

Why the loss is computed here and not by the model: ``model(..., labels=...)`` materialises the
``[tokens, vocab]`` logits, the first memory wall at long context. With ``loss_type="chunked"`` the module
runs the decoder body and hands the final hidden states and the LM-head weight to
:func:`lit_memtrain.loss.chunked_cross_entropy`, which never holds the full logits.

The model is always called with ``use_cache=False``; padding-free batches carry ``position_ids`` and no
attention mask, which is how transformers keeps packed documents from attending to each other.
"""

from __future__ import annotations

import importlib.util
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn
from torchmetrics import MeanMetric
from transformers import PreTrainedModel

from lit_memtrain.attention import SDPA_BY_DOCUMENT
from lit_memtrain.lora import LoraSettings, apply_lora, head_weight
from lit_memtrain.loss import IGNORE_INDEX, chunked_cross_entropy, cross_entropy
from lit_memtrain.model_builder import (
    ModelRecipe,
    build_causal_lm,
    build_causal_lm_skeleton,
    check_tokenizer_fits_model,
    export_hf_directory,
    export_sharded_hf_directory,
    load_sharded,
)
from lit_memtrain.step_tokens import STEP_TRAINABLE_TOKENS, count_step_tokens_during_fit
from lit_memtrain.strategies.fsdp2 import FSDP2Strategy
from lit_memtrain.strategies.parallelize import is_sharded, run_inside_forward

_BATCH_ONLY_KEYS = ("labels", "num_trainable_tokens", "num_tokens", "seq_lengths", STEP_TRAINABLE_TOKENS)
_VARLEN_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
_DOCUMENT_AWARE_ATTENTION = frozenset({"eager", "sdpa", "flex_attention", SDPA_BY_DOCUMENT})


def shift_targets(labels: Tensor) -> Tensor:
    """Targets aligned with each position: ``labels`` moved left by one, -100 at the last position."""
    return F.pad(labels[..., 1:], (0, 1), value=IGNORE_INDEX)


def _check_attn_implementation(name: str) -> None:
    if name.startswith("flash_attention") and importlib.util.find_spec("flash_attn") is None:
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
        preset: a preset name from :data:`lit_memtrain.presets.PRESETS` (random weights), used when
            ``model`` is not given; ``config`` may be a dict with ``model_type`` instead.
        config_overrides: config values applied on top of the preset (for example ``num_hidden_layers``).
        tokenizer: tokenizer to export with the model (linked to the datamodule's by the CLI). A model built
            from a preset takes its vocabulary size from it unless ``config_overrides`` sets ``vocab_size``.
        dtype: parameter dtype: ``float32``, ``bfloat16``, ``float16`` or ``auto`` (the checkpoint's).
        attn_implementation: ``sdpa``, ``eager``, ``flex_attention``, ``flash_attention_2``, a hub kernel
            name such as ``kernels-community/flash-attn``, or ``sdpa_by_document`` (SDPA once per packed
            document, without the dense L x L mask ``sdpa`` builds for padding-free rows; see
            :mod:`lit_memtrain.attention`).
        model_init_kwargs: extra arguments for the model constructor, e.g. YaRN
            ``{"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
            "original_max_position_embeddings": 40960}}``.
        loss_type: ``chunked`` (never materialises the logits) or ``nll`` (plain logits + cross-entropy).
        loss_chunk_size: rows per chunk of the chunked loss.
        learning_rate, weight_decay, betas: AdamW settings; no decay on biases and norm weights.
        warmup: warmup steps (int) or fraction of the total steps (float < 1), then cosine decay
            to ``min_lr_ratio * learning_rate``.

        lora: train a LoRA adapter instead of all weights (:class:`~lit_memtrain.lora.LoraSettings`);
            with ``quantize`` the base is loaded in 4 or 8 bits (QLoRA, CUDA only). When the base comes from
            ``model``, checkpoints hold only the adapter.
        export_dir: at the end of fit, write a Hugging Face directory (model + tokenizer, adapter merged) here.
        trust_remote_code: passed to ``from_pretrained`` / ``from_config``.

    Loss normalisation: every optimizer step trains on the mean loss of all its trainable target tokens,
    across gradient-accumulation micro-batches and data-parallel ranks, so each token weighs the same however
    the tokens fall into micro-batches (``train/loss`` shows each micro-batch's own mean). The step's count
    is known before its first backward (:mod:`lit_memtrain.step_tokens`), so every gradient (clipping,
    callbacks, GradScaler) is the gradient of that mean.

    The model is built in :meth:`configure_model`, which Lightning calls inside the strategy's device context
    (directly on the training device); outside a ``Trainer``, call ``module.configure_model()`` first. Under
    :class:`~lit_memtrain.strategies.FSDP2Strategy` it is sharded as it is built: see :meth:`configure_model`.

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
        attn_implementation: str = "sdpa",
        model_init_kwargs: dict[str, Any] | None = None,
        loss_type: Literal["chunked", "nll"] = "chunked",
        loss_chunk_size: int = 1024,
        learning_rate: float = 2e-5,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        warmup: float = 0.03,
        min_lr_ratio: float = 0.1,
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
        if warmup < 0 or not 0 <= min_lr_ratio <= 1:
            raise ValueError(f"warmup must be >= 0 and min_lr_ratio in [0, 1]; got {warmup} and {min_lr_ratio}.")
        _check_attn_implementation(attn_implementation)
        self.lora = lora
        self.save_hyperparameters()
        from lit_memtrain.tokenizer import load_tokenizer

        self.tokenizer = load_tokenizer(tokenizer) if tokenizer else None
        self.model: PreTrainedModel | None = None
        self.adapter_only_checkpoints = lora is not None and bool(model)
        self.strict_loading = not self.adapter_only_checkpoints
        self.train_tokens_seen = 0
        self._restore_dataloader_processing: Callable[[], None] | None = None
        self.first_train_loss: float | None = None
        self.last_train_loss: float | None = None
        self._step_started_at: float | None = None
        self.val_token_nll = MeanMetric()
        self.val_token_accuracy = MeanMetric()

    def configure_model(self) -> None:
        """Build the model (and its LoRA adapter) once; Lightning calls this inside the strategy's device context.

        Outside a ``Trainer`` (a notebook, a test), call it yourself before using ``module.model``.

        Under :class:`~lit_memtrain.strategies.FSDP2Strategy` the model is built sharded: global rank 0 loads
        (or initialises) the full model in host memory, the other ranks build it on the meta device; every
        rank shards it (:meth:`FSDP2Strategy.parallelize`: each decoder layer, then the root) and receives its
        shards from rank 0 one tensor at a time (:func:`~lit_memtrain.model_builder.load_sharded`), so no
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

    def _model_inputs(self, batch: dict[str, Any]) -> dict[str, Any]:
        inputs = {k: v for k, v in batch.items() if k not in _BATCH_ONLY_KEYS and k not in _VARLEN_KEYS}
        if "position_ids" in batch and "attention_mask" not in batch:
            self._check_documents_stay_apart(batch)
            name = self.model.config._attn_implementation
            if "flash" in name:
                inputs.update({k: batch[k] for k in _VARLEN_KEYS if k in batch})
            elif name == SDPA_BY_DOCUMENT and "cu_seq_lens_q" in batch:  # read once here, not once per layer
                inputs["cu_seq_lens_q"] = batch["cu_seq_lens_q"].cpu()
        inputs["use_cache"] = False
        return inputs

    def _check_documents_stay_apart(self, batch: dict[str, Any]) -> None:
        """Padding-free rows rely on the attention implementation splitting documents at position restarts.

        transformers does that for eager, sdpa and flex_attention (from ``position_ids``, with no attention mask
        and no cache) and for flash-attention kernels (varlen, from ``cu_seq_lens``); any other implementation
        would let packed documents attend to each other, so it is refused rather than trained on.
        """
        name = self.model.config._attn_implementation
        if name in _DOCUMENT_AWARE_ATTENTION or "flash" in name:
            return
        raise ValueError(
            f"attn_implementation={name!r} is not known to keep packed documents apart in a padding-free batch, "
            f"so documents would attend to each other. Use one of {sorted(_DOCUMENT_AWARE_ATTENTION)} or a "
            "flash-attention kernel, or turn off packing/padding_free."
        )

    def _lm_head_weight(self) -> tuple[Tensor, Tensor | None]:
        return head_weight(self.model.get_output_embeddings())

    def _softcap(self) -> float | None:
        config = self.model.config
        for unsupported in ("logit_scale", "logits_scaling"):
            if getattr(config, unsupported, None) not in (None, 1, 1.0):
                raise ValueError(
                    f"This model scales its logits ({unsupported}={getattr(config, unsupported)}), which the chunked "
                    "loss does not replicate. Use loss_type='nll'."
                )
        return getattr(config, "final_logit_softcapping", None)

    def _in_root_forward(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` where the model's root parameters are usable.

        Under FSDP2 the embeddings and LM head are gathered only inside the root module's forward, and the
        chunked loss reads the head's weight and calls the decoder directly: run it as the root's forward
        (the head is then gathered once per step, not once per chunk).
        """
        if is_sharded(self.model):
            return run_inside_forward(self.model, fn, *args)
        return fn(*args)

    def _hidden_and_head(self, batch: dict[str, Any]) -> tuple[Tensor, Tensor, Tensor | None]:
        decoder = self.model.get_decoder()
        hidden = decoder(**self._model_inputs(batch)).last_hidden_state
        weight, bias = self._lm_head_weight()
        # A LoRA head keeps fp32 adapters on a bf16 base: compute the loss in the hidden states' dtype.
        bias = bias.to(hidden.dtype) if bias is not None else None
        return hidden.flatten(0, 1), weight.to(hidden.dtype), bias

    def compute_loss(self, batch: dict[str, Any], num_items: int | Tensor | None = None) -> Tensor:
        """Mean cross-entropy over the batch's trainable target tokens (or divided by ``num_items``)."""
        targets = shift_targets(batch["labels"]).flatten()
        if self.hparams.loss_type == "nll":
            logits = self.model(**self._model_inputs(batch)).logits
            return cross_entropy(logits.flatten(0, 1), targets, num_items)
        return self._in_root_forward(self._chunked_loss, batch, targets, num_items)

    def _chunked_loss(self, batch: dict[str, Any], targets: Tensor, num_items: int | Tensor | None) -> Tensor:
        hidden, weight, bias = self._hidden_and_head(batch)
        return chunked_cross_entropy(
            hidden, weight, targets, num_items, self.hparams.loss_chunk_size, self._softcap(), bias
        )

    @torch.no_grad()
    def token_losses(self, batch: dict[str, Any]) -> tuple[Tensor, Tensor, Tensor]:
        """Per-token loss, correctness of the argmax prediction, and position in document, for trainable targets."""
        if self.hparams.loss_type == "nll":  # calls the model itself
            return self._token_losses(batch)
        return self._in_root_forward(self._token_losses, batch)

    def _token_losses(self, batch: dict[str, Any]) -> tuple[Tensor, Tensor, Tensor]:
        targets = shift_targets(batch["labels"]).flatten()
        keep = targets != IGNORE_INDEX
        if "position_ids" in batch:
            positions = batch["position_ids"].expand_as(batch["labels"]).flatten()
        else:
            positions = torch.arange(batch["labels"].shape[-1], device=targets.device).expand_as(batch["labels"])
            positions = positions.flatten()
        if self.hparams.loss_type == "nll":
            hidden = self.model(**self._model_inputs(batch)).logits.flatten(0, 1)[keep]
            weight, bias, softcap = None, None, None
        else:
            hidden, weight, bias = self._hidden_and_head(batch)
            hidden, softcap = hidden[keep], self._softcap()
        losses, correct = [], []
        for start in range(0, hidden.shape[0], self.hparams.loss_chunk_size):
            rows = hidden[start : start + self.hparams.loss_chunk_size]
            logits = rows.float() if weight is None else F.linear(rows, weight, bias).float()
            if softcap:
                logits = softcap * torch.tanh(logits / softcap)
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
        """Real (non-padding) input tokens in a batch."""
        if "num_tokens" in batch:
            return int(batch["num_tokens"])
        if "attention_mask" in batch:
            return int(batch["attention_mask"].sum())
        return batch["input_ids"].numel()

    @staticmethod
    def count_trainable_targets(batch: dict[str, Any]) -> int:
        """Target tokens the loss of ``batch`` sums over (labels after the shift that are not -100)."""
        return int((shift_targets(batch["labels"]) != IGNORE_INDEX).sum())

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
        mean = loss_sum.detach() / (shift_targets(batch["labels"]) != IGNORE_INDEX).sum().clamp(min=1)
        self.train_tokens_seen += self.count_tokens(batch)
        value = mean.item()
        if self.first_train_loss is None:
            self.first_train_loss = value
        self.last_train_loss = value
        self.log("train/loss", mean, prog_bar=True)
        self.log("train/ppl", math.exp(min(value, 50.0)))
        self.log("train/tokens", float(self.train_tokens_seen))
        return loss

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._step_started_at = time.perf_counter()
        self._step_tokens = self.count_tokens(batch)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        elapsed = time.perf_counter() - self._step_started_at
        if elapsed > 0:
            tokens_per_sec = self._step_tokens * self.trainer.world_size / elapsed
            self.log("train/tokens_per_sec", tokens_per_sec, prog_bar=True)

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
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": hp.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=hp.learning_rate,
            betas=tuple(hp.betas),
            fused=_fused_adamw_supported([p for _, p in trainable]),
        )
        total = max(1, int(self.trainer.estimated_stepping_batches))
        warmup = int(hp.warmup * total) if hp.warmup < 1 else int(hp.warmup)

        def lr_factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / (warmup + 1)
            progress = min(1.0, (step - warmup) / max(1, total - warmup))
            return hp.min_lr_ratio + (1 - hp.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

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
