"""CausalLMModule: supervised fine-tuning of a Hugging Face causal LM; this file is its training step.

Why the loss is computed here and not by the model: ``model(..., labels=...)`` materialises the ``[tokens, vocab]``
logits, the first memory wall at long context. With ``loss_type="chunked"`` the module runs the decoder body and
hands the final hidden states and the LM-head weight to :func:`lit_memtrain.techniques.loss.chunked_cross_entropy`,
which never holds the full logits. Building and exporting the model, the batch's keys, the step's token count, the
optimizer, the throughput meter and the setup probes live in files of their own (``docs/architecture.md``).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import lightning
import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor
from torchmetrics import MeanMetric
from torchmetrics.metric import CompositionalMetric
from transformers import PreTrainedModel

from lit_memtrain.datamodules.batch import IGNORE_INDEX, batch_targets, model_inputs
from lit_memtrain.models.builder import ModelRecipe, build_sharded_training_model, build_training_model, gguf_tokenizer
from lit_memtrain.models.builder import export_hf_directory, export_sharded_hf_directory
from lit_memtrain.models.lora import LoraSettings, head_weight
from lit_memtrain.models.moe import load_balancing_loss, router_aux_coefficient
from lit_memtrain.objectives.checkpoint_files import save_to_first_writable
from lit_memtrain.objectives.checkpoint_io import lit_memtrain_class_path, saved_vocabulary
from lit_memtrain.objectives.optim import optimizer_and_schedule, plain_spec
from lit_memtrain.objectives.probes import LogitTransform, SetupProbes, check_no_extra_loss_terms
from lit_memtrain.objectives.rng_state import every_ranks_rng_states, set_rng_states
from lit_memtrain.objectives.step_tokens import count_step_tokens_during_fit, micro_batch_mean
from lit_memtrain.objectives.step_tokens import resume_scheduled_accumulation, step_trainable_tokens
from lit_memtrain.objectives.throughput import ThroughputMeter, count_tokens
from lit_memtrain.parallel.fsdp import is_sharded, run_inside_forward
from lit_memtrain.techniques.attention import (
    SDPA_BY_DOCUMENT,
    VARLEN_BY_DOCUMENT,
    check_flash_attn,
    choose_document_attention,
)
from lit_memtrain.techniques.loss import chunked_cross_entropy, chunked_token_losses, cross_entropy


class CausalLMModule(LightningModule):
    """Fine-tune a causal LM from the hub, a local directory, or random weights from a preset/config.

    Args:
        model: hub id or local path passed to ``AutoModelForCausalLM.from_pretrained``; or a GGUF file, dequantized
            to float: a ``.gguf`` path, a directory or hub id with ``model_init_kwargs={"gguf_file": name}``, or a
            packaged model's short name (``smollm2-135m-instruct``, :data:`~lit_memtrain.datamodules.gguf_files.
            PACKAGED_GGUF`).
        preset: a preset name from :data:`lit_memtrain.models.presets.PRESETS` (random weights), used when
            ``model`` is not given; ``config`` may be a dict with ``model_type`` instead.
        config_overrides: config values applied on top of the preset (for example ``num_hidden_layers``).
        tokenizer: tokenizer to export with the model (linked to the datamodule's by the CLI); without one, a GGUF
            model's own (its chat template too), and no tokenizer for other sources. A preset keeps
            its own vocabulary (``config_overrides`` may set ``vocab_size``) and the tokenizer must fit inside it;
            a config dict that names no ``vocab_size`` takes the tokenizer's length.
        dtype: parameter dtype: ``float32``, ``bfloat16``, ``float16`` or ``auto`` (the checkpoint's).
        attn_implementation: ``sdpa``, ``eager``, ``flex_attention``, ``flash_attention_2``, a hub kernel such
            as ``kernels-community/flash-attn``, or ``sdpa_by_document`` / ``varlen_by_document`` (per packed
            document, without the dense L x L mask of ``sdpa``: :mod:`lit_memtrain.techniques.attention`). ``None``
            (the default) picks, once and logged, the fastest that keeps packed documents apart on the training
            device (:func:`~lit_memtrain.techniques.attention.choose_document_attention`).
        model_init_kwargs: extra arguments for the model constructor, e.g. YaRN
            ``{"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
            "original_max_position_embeddings": 40960}}``.
        loss_type: ``chunked`` (never materialises the logits) or ``nll`` (plain logits + cross-entropy).
        loss_chunk_size: rows per chunk of the chunked loss.
        router_aux_loss_coef: weight of a mixture-of-experts model's router load-balancing loss in the training
            loss; ``None`` takes the model's own (``router_aux_loss_coef``, JetMoE's ``aux_loss_coef``, DBRX's
            ``moe_loss_weight``), 0 turns it off.
        learning_rate, weight_decay, betas: AdamW settings; no decay on biases and norm weights.
        warmup: warmup steps (int) or fraction of the total steps (float < 1), then cosine decay
            to ``min_lr_ratio * learning_rate``.
        optimizer: another optimizer, as ``{"class_path": "torch.optim.SGD", "init_args": {"lr": 0.1}}`` (any
            ``torch.optim`` class, or :mod:`lit_memtrain.objectives.optim`'s 8-bit / paged AdamW) with its own init
            args; biases and norm weights still get no weight decay. ``lit-memtrain fit`` links ``--optimizer`` here.
        lr_scheduler: another schedule, as ``{"class_path": ..., "init_args": {...}}``, stepped every optimizer
            step, in place of warmup-cosine. ``lit-memtrain fit`` links ``--lr_scheduler`` here.
        lora: train a LoRA adapter instead of all weights (:class:`~lit_memtrain.models.lora.LoraSettings`);
            with ``quantize`` the base is loaded in 4 or 8 bits (QLoRA, CUDA only). When the base comes from
            ``model``, checkpoints hold only the adapter.
        export_dir: at the end of fit, write a Hugging Face directory (model + tokenizer, adapter merged) here.
        trust_remote_code: passed to ``from_pretrained`` / ``from_config``.

    Each optimizer step trains on the mean loss of all its trainable target tokens, over its micro-batches and
    ranks (:mod:`~lit_memtrain.objectives.step_tokens`; also under a ``GradientAccumulationScheduler``). Logged:
    ``train/loss`` and ``train/ppl`` (each micro-batch's own mean), ``train/tokens`` and the throughput
    (``ThroughputMeter`` of :mod:`~lit_memtrain.objectives.throughput`), ``val/loss``, ``val/ppl`` and
    ``val/token_accuracy`` (over the whole validation set, every rank's tokens). The model is built in
    :meth:`configure_model` (outside a ``Trainer``, call it first); :meth:`run_setup_probes` checks once that the
    chunked loss computes the model's own logits and that packed documents stay apart.

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
        check_flash_attn(attn_implementation)
        # LightningCLI links --optimizer / --lr_scheduler as namespaces: keep plain dicts in the hyper-parameters.
        optimizer, lr_scheduler = plain_spec(optimizer), plain_spec(lr_scheduler)
        self.lora = lora
        self.save_hyperparameters()
        from lit_memtrain.datamodules.tokenizer import load_tokenizer

        self.tokenizer = load_tokenizer(tokenizer) if tokenizer else gguf_tokenizer(self.recipe)
        self.model: PreTrainedModel | None = None
        self.adapter_only_checkpoints = lora is not None and bool(model)
        self.strict_loading = not self.adapter_only_checkpoints
        self.throughput = ThroughputMeter()
        self.setup_probes = SetupProbes()
        token_nll = MeanMetric()
        # What on_validation_epoch_end logs as val/<name>: torchmetrics, summed over every rank when computed.
        self.val_metrics = torch.nn.ModuleDict(
            {"loss": token_nll, "ppl": CompositionalMetric(torch.exp, token_nll, None), "token_accuracy": MeanMetric()}
        )
        self._restore_dataloader_processing: Callable[[], None] | None = None
        self._first_loss: Tensor | None = None
        self._resumed_rng_states: dict[str, Any] | None = None  # this rank's, put back when the resumed fit trains
        self._saving_on_every_rank = True  # False while one rank alone saves (_keep_trained): no collective then
        self._last_loss: Tensor | None = None


    def configure_model(self) -> None:
        """Build the model (and its LoRA adapter) once; Lightning calls this inside the strategy's device context.

        Under a strategy that offers ``parallelize(model)`` (Lightning's convention for one that shards, as
        :class:`~lit_memtrain.strategies.FSDP2Strategy` does) the model is sharded as it is built
        (:func:`~lit_memtrain.models.builder.build_sharded_training_model`); so is one built before the fit.
        """
        strategy = self._trainer.strategy if self._trainer is not None else None
        if hasattr(strategy, "parallelize"):
            if not is_sharded(self.model):
                self.model, self.recipe = build_sharded_training_model(
                    self.recipe, strategy.parallelize, strategy.parameter_device, strategy.root_device,
                    strategy.global_rank, self.tokenizer, self.hparams.tokenizer, self._document_attention, self.model,
                )  # fmt: skip
            return
        if hasattr(type(strategy), "device_mesh"):  # the class's: reading a mesh before the strategy's setup raises
            raise TypeError(
                f"CausalLMModule does not parallelise itself under {type(strategy).__name__}; use "
                "lit_memtrain.strategies.FSDP2Strategy (sharded data parallelism, with host offload if needed)."
            )
        if self.model is None:
            self.model, self.recipe = build_training_model(
                self.recipe, self.tokenizer, self.hparams.tokenizer, self._document_attention
            )

    def _document_attention(self, model: PreTrainedModel) -> str:
        """The fastest attention that keeps packed documents apart on the training device, said once chosen."""
        trainer = self._trainer
        device = trainer.strategy.root_device if trainer is not None else model.device
        precision = str(trainer.precision) if trainer is not None else ""
        half_precision = model.dtype in (torch.float16, torch.bfloat16) or precision.startswith(("bf16", "16"))
        name = choose_document_attention(model, device, half_precision)
        rank_zero_info(f"attn_implementation: {name!r}, the fastest that keeps packed documents apart on {device.type}")
        return name

    def _model_inputs(self, batch: dict[str, Any]) -> dict[str, Any]:
        name = self.model.config._attn_implementation
        by_document = name in (SDPA_BY_DOCUMENT, VARLEN_BY_DOCUMENT)
        return model_inputs(batch, varlen="flash" in name, cu_seq_lens_on_host=by_document)

    def export(self, directory: str | Path) -> Path | None:
        """Write a Hugging Face directory (model with any adapter merged, and tokenizer) that ``from_pretrained`` loads.

        A sharded model is gathered into rank 0's host memory and written there: every rank must call this,
        and ranks other than 0 get ``None``.
        """
        if is_sharded(self.model):
            return export_sharded_hf_directory(self.model, self.recipe, directory, self.tokenizer)
        return export_hf_directory(self.model, self.recipe, directory, self.tokenizer)


    def run_setup_probes(self, batch: dict[str, Any] | None = None) -> None:
        """Run, once each, the probes (:class:`~lit_memtrain.objectives.probes.SetupProbes`) this module's loss and
        ``batch`` need: in a ``Trainer``, at fit or validation start and at the first padding-free batch; called
        directly, from the first :meth:`compute_loss` or :meth:`token_losses`. A model whose own loss adds a term
        this module does not compute is refused (:func:`~lit_memtrain.objectives.probes.check_no_extra_loss_terms`)."""
        check_no_extra_loss_terms(self.model)
        self.setup_probes.run(self.model, self.hparams.loss_type == "chunked", batch, self._model_inputs)

    def on_fit_start(self) -> None:
        self.run_setup_probes()

    def on_validation_start(self) -> None:
        self.run_setup_probes()

    def on_validation_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self.run_setup_probes(batch)


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
        inputs = self._model_inputs(batch)
        if output_router_logits:
            inputs["output_router_logits"] = True
        outputs = self.model.get_decoder()(**inputs)
        hidden = outputs.last_hidden_state
        weight, bias = head_weight(self.model.get_output_embeddings())
        # A LoRA head keeps fp32 adapters on a bf16 base: compute the loss in the hidden states' dtype.
        bias = bias.to(hidden.dtype) if bias is not None else None
        router_logits = getattr(outputs, "router_logits", None) if output_router_logits else None
        return hidden.flatten(0, 1), weight.to(hidden.dtype), bias, router_logits

    def router_aux_weight(self) -> float:
        """Weight of the router load-balancing loss: ``router_aux_loss_coef``, else the one the model's own forward
        uses; 0 for a model without routers."""
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
        total = trainable if num_items is None else torch.as_tensor(num_items, device=trainable.device)
        return loss + coefficient * aux.to(loss.device) * (trainable / total.clamp(min=1))

    def _chunked_loss(
        self, batch: dict[str, Any], targets: Tensor, num_items: int | Tensor | None, coefficient: float
    ) -> tuple[Tensor, Tensor | None]:
        """The chunked cross-entropy and, with a non-zero ``coefficient``, the router load-balancing loss."""
        hidden, weight, bias, router_logits = self._hidden_and_head(batch, output_router_logits=bool(coefficient))
        transform = self.setup_probes.logit_transform
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
        positions = batch.get("position_ids")
        if positions is None:
            positions = torch.arange(shaped_targets.shape[-1], device=targets.device)
        positions = positions.expand_as(shaped_targets).flatten()
        if self.hparams.loss_type == "nll":
            hidden = self.model(**self._model_inputs(batch)).logits.flatten(0, 1)[keep]
            weight, bias, transform = None, None, LogitTransform()
        else:
            hidden, weight, bias, _ = self._hidden_and_head(batch)
            hidden, transform = hidden[keep], self.setup_probes.logit_transform
        losses, correct = chunked_token_losses(
            hidden, weight, targets[keep], self.hparams.loss_chunk_size, transform.softcap, bias, transform.scale
        )
        return losses, correct, positions[keep] + 1

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

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        # The loss backpropagated is this micro-batch's sum of token losses divided by the trainable tokens of
        # the whole optimizer step (all micro-batches, all ranks), times the factors Lightning (which divides
        # by accumulate_grad_batches) and DDP / FSDP2 (which average gradients over ranks) divide by again.
        trainer, mesh = self.trainer, self.device_mesh
        loss_sum = self.compute_loss(batch, num_items=1)
        step_tokens = step_trainable_tokens(batch, trainer, self.count_trainable_targets, self.device, mesh)
        loss = loss_sum * (trainer.accumulate_grad_batches * trainer.world_size / step_tokens.clamp(min=1))
        mean = micro_batch_mean(loss_sum.detach(), (batch_targets(batch) != IGNORE_INDEX).sum(), mesh)
        if self._first_loss is None:  # kept on the device: reading it now would wait for the step to finish
            self._first_loss = mean
        self._last_loss = mean
        self.log("train/loss", mean, prog_bar=True)
        self.log("train/ppl", torch.exp(mean.clamp(max=50.0)))
        self.log("train/tokens", self.throughput.tokens_seen_metric())
        return loss

    def on_train_start(self) -> None:
        if self._resumed_rng_states is not None:  # after the sanity check, before the first resumed batch
            set_rng_states(self._resumed_rng_states)
            self._resumed_rng_states = None
        resume_scheduled_accumulation(self.trainer)
        self.throughput.start(self.device, self.trainer.global_step)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.run_setup_probes(batch)
        self.throughput.count(batch, self.trainer.world_size, self.device, self.trainer.strategy.reduce)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        trainer = self.trainer
        metrics = self.throughput.update(
            trainer.global_step, trainer.log_every_n_steps, trainer.max_steps, self.model, self.device,
            str(trainer.precision),
        )  # fmt: skip
        # Logged when measured, not at every step: Lightning reports the value at every later step of the epoch (its
        # logger and progress bar read the same figures), and each self.log costs host time (0.24 ms on this CPU).
        # Host tensors, not floats: Lightning makes a logged float a tensor on the module's device, a copy from host
        # memory that waits for the device (one sync per metric per step); a host tensor stays there. At least fp32,
        # as Lightning's own conversion (a bf16 default dtype would round them).
        dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
        for name, value in metrics.items():
            self.log(name, torch.tensor(value, dtype=dtype), prog_bar=name == "train/tokens_per_sec")

    def configure_optimizers(self) -> dict[str, Any]:
        """AdamW (or ``optimizer``) and warmup-cosine (or ``lr_scheduler``), as
        :func:`~lit_memtrain.objectives.optim.optimizer_and_schedule` builds them."""
        hp, trainer = self.hparams, self.trainer
        return optimizer_and_schedule(
            self.named_parameters(), learning_rate=hp.learning_rate, weight_decay=hp.weight_decay, betas=hp.betas,
            warmup=hp.warmup, min_lr_ratio=hp.min_lr_ratio, optimizer=hp.optimizer, lr_scheduler=hp.lr_scheduler,
            stepping_batches=lambda: trainer.estimated_stepping_batches,
            scaler_clips_gradients=lambda: (
                getattr(trainer.precision_plugin, "scaler", None) is not None and bool(trainer.gradient_clip_val)
            ),
        )  # fmt: skip

    def on_train_end(self) -> None:
        if self.first_train_loss is not None:
            self.print(
                f"train loss: first {self.first_train_loss:.4f} -> last {self.last_train_loss:.4f} "
                f"over {self.trainer.global_step} steps, {self.train_tokens_seen} tokens"
            )

    def on_fit_end(self) -> None:
        # A sharded model is gathered by every rank together; rank 0 writes it.
        if self.hparams.export_dir and (self.trainer.is_global_zero or is_sharded(self.model)):
            replaced = Path(self.hparams.export_dir).exists()
            try:
                path = self.export(self.hparams.export_dir)
            except Exception as error:
                message = f"The export to {self.hparams.export_dir} failed ({error}); {self._keep_trained()}"
                kept = OSError(error.errno, message) if isinstance(error, OSError) else RuntimeError(message)
                raise kept from error
            replacing = " (it replaced the earlier export there)" if replaced else ""
            self.print(f"exported Hugging Face model to {path}{replacing}")

    def _keep_trained(self) -> str:
        """Save the trained weights where they can be written, after a failed export; where they are, in words."""
        trainer = self.trainer
        step = trainer.global_step
        if is_sharded(self.model):
            saved = [cb.last_model_path for cb in trainer.checkpoint_callbacks if getattr(cb, "last_model_path", "")]
            return f"the last checkpoint is {saved[0]}" if saved else "the trained weights were not saved"
        checkpoint = {
            "global_step": step, "state_dict": self.state_dict(), "hyper_parameters": dict(self.hparams),
            "pytorch-lightning_version": lightning.__version__,
        }  # fmt: skip
        self._saving_on_every_rank = False  # rank 0 alone writes this one: gathering the ranks' generators would hang
        try:
            self.on_save_checkpoint(checkpoint)
        finally:
            self._saving_on_every_rank = True
        folders = [cb.dirpath for cb in trainer.checkpoint_callbacks if getattr(cb, "dirpath", None)]
        folders += [logger.save_dir for logger in trainer.loggers if logger.save_dir]
        folders += [trainer.default_root_dir, tempfile.gettempdir()]
        folders = [folder for folder in folders if "://" not in str(folder)]  # a local file, for the export to read
        path, failures = save_to_first_writable(checkpoint, f"trained-step={step}.ckpt", folders)
        if path is None:
            return f"the trained weights could not be saved either ({'; '.join(failures)})"
        return (
            f"the trained weights are saved in {path}: lit-memtrain export --checkpoint {path} --output <folder> "
            "writes the export from them"
        )


    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> dict[str, Tensor]:
        losses, correct, positions = self.token_losses(batch)
        if losses.numel():
            self.val_metrics["loss"].update(losses)
            self.val_metrics["token_accuracy"].update(correct.float())
        loss = losses.mean() if losses.numel() else losses.sum()
        return {"loss": loss, "token_losses": losses, "token_positions": positions}

    def on_validation_epoch_start(self) -> None:
        # Lightning resets logged metrics inside its evaluation context: states made under inference mode could not
        # be updated under no_grad (a later validation on gloo, or with inference_mode=False).
        with torch.inference_mode(False):
            for metric in self.val_metrics.values():
                metric.reset()

    def on_validation_epoch_end(self) -> None:
        # The metric objects are logged, on every rank: Lightning computes each once, over every rank's updates (the
        # value of the whole validation set), and does not ask for sync_dist as it does of a tensor logged here.
        for name, metric in self.val_metrics.items():
            self.log(f"val/{name}", metric, prog_bar=name == "loss")


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
        return int(self.throughput.tokens_seen)

    @train_tokens_seen.setter
    def train_tokens_seen(self, value: int) -> None:
        self.throughput.tokens_seen = value

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["lit_memtrain"] = {
            "module_class": lit_memtrain_class_path(type(self)),
            "train_tokens_seen": self.train_tokens_seen,
            "first_train_loss": self.first_train_loss,
            "last_train_loss": self.last_train_loss,
            # resumed, a W&B logger continues its run (this id): lit_memtrain.cli.resume
            "logger_versions": [
                logger.version if isinstance(logger.version, (str, int)) else None for logger in self.trainer.loggers
            ] if self._trainer else [],
        }
        if self._saving_on_every_rank:  # every rank's generators: a resumed fit draws what the uninterrupted one would
            checkpoint["lit_memtrain"]["rng_states"] = every_ranks_rng_states()
        # A distributed checkpoint of a sharded run keeps every tensor: it is loaded key by key, frozen base included.
        if self.adapter_only_checkpoints and not is_sharded(self.model):
            trainable = {f"model.{name}" for name, p in self.model.named_parameters() if p.requires_grad}
            checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k in trainable}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        shapes = {key: tensor.shape for key, tensor in checkpoint.get("state_dict", {}).items()}
        vocabulary = saved_vocabulary(self.hparams, shapes).get("config_overrides", {}).get("vocab_size")
        built = self.model.get_input_embeddings().weight.shape[0] if self.model is not None else None
        if vocabulary is not None and built is not None and not is_sharded(self.model) and vocabulary != built:
            raise ValueError(
                f"The checkpoint's model has a vocabulary of {vocabulary} rows and this one {built} (the preset's): "
                "before lit-memtrain 0.2 a preset model took its tokenizer's vocabulary. Resume it with "
                f"model.config_overrides.vocab_size: {vocabulary}."
            )
        counters = checkpoint.get("lit_memtrain", {})
        self.train_tokens_seen = counters.get("train_tokens_seen", 0)
        self.first_train_loss = counters.get("first_train_loss")
        self.last_train_loss = counters.get("last_train_loss")
        rng_states = counters.get("rng_states")
        if rng_states is None or self._trainer is None:  # loaded to export or evaluate: nothing will sample on from it
            return
        if len(rng_states) == self.trainer.world_size:
            self._resumed_rng_states = rng_states[self.global_rank]
        else:
            rank_zero_warn(
                f"The checkpoint holds the random generators of {len(rng_states)} ranks and this run has "
                f"{self.trainer.world_size}: "
                "they are not restored, so what the resumed fit samples differs from the uninterrupted run's."
            )
