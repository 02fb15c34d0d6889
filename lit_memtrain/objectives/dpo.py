"""DPOModule: preference training (DPO, IPO) with the model path and memory techniques of SFT.

Why a subclass of :class:`~lit_memtrain.objectives.causal_lm.CausalLMModule`: model building (presets, hub, LoRA /
QLoRA, the attention choice and its probes), the sharded build and root-forward under
:class:`~lit_memtrain.strategies.FSDP2Strategy`, the optimizer and schedule, throughput logging, exports and
checkpoints are the same; only what a batch is trained on differs. Every memory callback
(checkpointing, tiled MLP, activation offloading) acts on the model and so composes unchanged.

One step: the policy runs once over all ``2 B`` sequences of a batch (padded, or padding-free in one row);
the log-probabilities of the completion tokens come from the final hidden states a chunk of rows at a time
(:func:`~lit_memtrain.techniques.logprobs.chunked_token_log_probs`, never the ``[tokens, vocab]`` logits) and are
summed per sequence; :func:`~lit_memtrain.objectives.preference_loss.preference_loss` compares them with the
reference's.

The reference model is never a second copy of the model:

- ``precomputed``: before training, one pass of the initial model (eval mode, no gradients) over the
  training and validation pairs stores their log-probabilities with the dataset
  (:meth:`PreferenceDataModule.set_reference_logps`), and in checkpoints, so a resumed run keeps the
  initial model's values. A dataset that already has TRL's ``ref_chosen_logps`` / ``ref_rejected_logps``
  columns is used as is.
- ``adapter_disabled`` (LoRA only): each step also runs the same model with the adapter disabled, without
  gradients: the base model is the reference. A batch that carries ``ref_*_logps`` columns is refused: which
  of the two references the user meant cannot be told.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor
from torchmetrics import MeanMetric

from lit_memtrain.datamodules.batch import IGNORE_INDEX, scored_rows, shift_targets
from lit_memtrain.datamodules.preference_collate import REFERENCE_COLUMNS
from lit_memtrain.models.dropout import disable_dropout as disable_dropout_in_model
from lit_memtrain.objectives.causal_lm import CausalLMModule
from lit_memtrain.objectives.preference_loss import LOSS_TYPES, PreferenceLossType, preference_loss
from lit_memtrain.objectives.step_tokens import step_window
from lit_memtrain.techniques.logprobs import chunked_token_log_probs, token_log_probs

ReferenceMode = Literal["auto", "precomputed", "adapter_disabled"]
_PREFERENCE_KEYS = ("sequence_ids", "num_pairs", *REFERENCE_COLUMNS)
# What pair_loss reports besides the loss, and DPOModule logs (TRL's names).
_PAIR_METRICS = (
    "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected",
)  # fmt: skip


class DPOModule(CausalLMModule):
    """Align a causal LM on preference pairs with DPO's sigmoid loss or IPO.

    Args:
        beta: strength of the pull towards the reference (DPO's beta; IPO's tau).
        preference_loss: ``sigmoid`` (DPO) or ``ipo``.
        reference: where the reference log-probabilities come from: ``precomputed`` (one pass before
            training), ``adapter_disabled`` (with ``lora``: the base model, each step), ``auto`` (the latter with
            ``lora``, else the former).
        disable_dropout: TRL's (``DPOConfig``, default True): set every dropout probability of the model to 0 once it
            is built, a LoRA adapter's own (``lora.dropout``) included, so that the policy and the reference score a
            pair alike (at the first step, rewards 0); False keeps the model's dropout in training.
        **kwargs: every argument of :class:`~lit_memtrain.objectives.causal_lm.CausalLMModule` (model, preset, lora,
            dtype, attn_implementation, loss_type, loss_chunk_size, learning_rate, ...); ``loss_type="chunked"`` takes
            the log-probabilities from hidden states in chunks of ``loss_chunk_size`` rows, ``"nll"`` from the
            model's logits.

    Logged (``train/`` and ``val/``): ``loss``, ``rewards/chosen``, ``rewards/rejected``,
    ``rewards/accuracies``, ``rewards/margins``, ``logps/chosen``, ``logps/rejected``: the names TRL's
    ``DPOTrainer`` logs. The training loss is the mean over each micro-batch's pairs; with gradient accumulation
    a step trains on the mean of its micro-batches' means, as in TRL, an epoch's last, shorter step included (and
    under data parallelism, the mean over the ranks). The ``val/`` values are over the whole validation set, every
    rank's pairs, each pair weighing the same.

    Example:
        >>> module = DPOModule(preset="tiny-qwen3", tokenizer="lit-memtrain/embedded", beta=0.1)
        >>> trainer = Trainer(max_steps=20)  # doctest: +SKIP
        >>> trainer.fit(module, datamodule=PreferenceDataModule(max_length=64))  # doctest: +SKIP
    """

    def __init__(
        self,
        beta: float = 0.1,
        preference_loss: PreferenceLossType = "sigmoid",
        reference: ReferenceMode = "auto",
        disable_dropout: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if not beta > 0:
            raise ValueError(f"beta must be > 0, got {beta}.")
        if preference_loss not in LOSS_TYPES:
            raise ValueError(f"preference_loss must be one of {LOSS_TYPES}, got {preference_loss!r}.")
        if reference not in ("auto", "precomputed", "adapter_disabled"):
            raise ValueError(f"reference must be 'auto', 'precomputed' or 'adapter_disabled', got {reference!r}.")
        if reference == "adapter_disabled" and self.lora is None:
            raise ValueError(
                "reference='adapter_disabled' takes the reference from the base model under a LoRA adapter, but "
                "no lora is set: set model.lora, or use reference='precomputed'."
            )
        self.reference_mode = reference if reference != "auto" else ("adapter_disabled" if self.lora else "precomputed")
        self.reference_logps: dict[str, tuple[Tensor, Tensor]] = {}
        self.val_metrics = torch.nn.ModuleDict({name: MeanMetric() for name in ("loss", *_PAIR_METRICS)})
        self._first_margin: Tensor | None = None
        self._last_margin: Tensor | None = None

    def configure_model(self) -> None:
        super().configure_model()
        if self.hparams.disable_dropout:  # after LoRA wraps the model, as TRL: the adapter's dropout goes too
            disable_dropout_in_model(self.model)

    # ----------------------------------------------------------------------------------- log-probs

    def sequence_logps(self, batch: dict[str, Any]) -> tuple[Tensor, Tensor]:
        """Summed completion log-probabilities and completion token counts of the batch's ``2 B`` sequences
        (chosen ones first), each ``[2 B]``."""
        self.run_setup_probes(batch)
        model_batch = {k: v for k, v in batch.items() if k not in _PREFERENCE_KEYS}
        targets = shift_targets(batch["labels"]).flatten()
        if self.hparams.loss_type == "nll":
            logits = self.model(**self._model_inputs(model_batch)).logits
            token_logps = token_log_probs(logits.flatten(0, 1), targets)
        else:
            token_logps = self._in_root_forward(self._chunked_token_logps, model_batch, targets)
        sequences = 2 * int(batch["num_pairs"])
        ids = batch["sequence_ids"].flatten()  # padding is sequence 2B, dropped below
        sums = token_logps.new_zeros(sequences + 1).index_add(0, ids, token_logps)[:sequences]
        # Shapes that do not depend on values (no bincount, no boolean mask): no device sync, and the planner's
        # fake tensors run this very code.
        trainable = (targets != IGNORE_INDEX).long()
        counts = torch.zeros(sequences + 1, dtype=torch.long, device=ids.device).index_add(0, ids, trainable)
        return sums, counts[:sequences]

    def _chunked_token_logps(self, batch: dict[str, Any], targets: Tensor) -> Tensor:
        hidden, weight, bias, _ = self._hidden_and_head(batch)
        transform = self.setup_probes.logit_transform
        return chunked_token_log_probs(
            hidden, weight, targets, self.hparams.loss_chunk_size, transform.softcap, bias, transform.scale
        )

    def batch_reference_logps(self, batch: dict[str, Any]) -> tuple[Tensor, Tensor]:
        """The reference's chosen and rejected log-probabilities of a batch's pairs, each ``[B]``: the batch's
        ``ref_chosen_logps`` / ``ref_rejected_logps`` (``precomputed``), or the model with its adapter disabled
        (``adapter_disabled``), which refuses a batch that carries those columns: two references, and neither
        may be picked silently."""
        carried = [name for name in REFERENCE_COLUMNS if name in batch]
        if self.reference_mode == "adapter_disabled":
            if carried:
                raise ValueError(
                    f"The batch carries precomputed reference log-probabilities ({', '.join(carried)}), but "
                    f"reference={self.hparams.reference!r} (with lora, 'auto' is 'adapter_disabled') takes the "
                    "reference from the base model with the adapter disabled, at each step. To use the columns, set "
                    "reference='precomputed'; to use the base model, remove the columns from the dataset."
                )
            with torch.no_grad(), self.model.disable_adapter():
                logps, _ = self.sequence_logps(batch)
            return logps.chunk(2)
        if len(carried) < len(REFERENCE_COLUMNS):
            raise RuntimeError(
                "The batch has no reference log-probabilities (ref_chosen_logps / ref_rejected_logps). With "
                "reference='precomputed' DPOModule computes them at fit start for a PreferenceDataModule; with other "
                "data, add those columns to the dataset, or train a LoRA adapter (reference='adapter_disabled')."
            )
        return batch["ref_chosen_logps"], batch["ref_rejected_logps"]

    def pair_terms(self, batch: dict[str, Any]) -> dict[str, Tensor]:
        """Each pair's loss and the values whose means are the metrics TRL logs (:data:`_PAIR_METRICS`), ``[B]``."""
        logps, counts = self.sequence_logps(batch)
        chosen, rejected = logps.chunk(2)
        chosen_tokens, rejected_tokens = counts.chunk(2)
        ref_chosen, ref_rejected = self.batch_reference_logps(batch)
        out = preference_loss(
            chosen, rejected, ref_chosen, ref_rejected, self.hparams.beta, self.hparams.preference_loss,
            chosen_tokens, rejected_tokens,
        )
        return {
            "loss": out.losses,
            "rewards/chosen": out.chosen_rewards,
            "rewards/rejected": out.rejected_rewards,
            "rewards/accuracies": (out.chosen_rewards > out.rejected_rewards).float(),
            "rewards/margins": out.chosen_rewards - out.rejected_rewards,
            "logps/chosen": chosen.detach(),
            "logps/rejected": rejected.detach(),
        }

    def pair_loss(self, batch: dict[str, Any]) -> tuple[Tensor, dict[str, Tensor]]:
        """Mean loss over the batch's pairs, and the metrics TRL logs (means over the pairs)."""
        values = self.pair_terms(batch)
        return values.pop("loss").mean(), {name: value.mean() for name, value in values.items()}

    # ------------------------------------------------------------------------ precomputed reference

    def on_fit_start(self) -> None:
        super().on_fit_start()
        if self.router_aux_weight():
            raise ValueError(
                f"{type(self.model).__name__} has routers: DPOModule does not add the router load-balancing loss. "
                "Set router_aux_loss_coef=0 to align it without that loss."
            )
        if self.reference_mode == "precomputed":
            self.precompute_reference_logps()

    def precompute_reference_logps(self, compute: bool = True) -> None:
        """Give the training and validation pairs of a :class:`PreferenceDataModule` the current model's
        log-probabilities (once: values restored from a checkpoint, or already in the dataset, are kept;
        ``compute=False`` applies those only). Other data must carry ``ref_chosen_logps`` /
        ``ref_rejected_logps`` itself."""
        datamodule = self.trainer.datamodule
        if not hasattr(datamodule, "set_reference_logps"):  # other data must carry them: checked at each batch
            return
        for split in ("train", "validation"):
            if split not in datamodule.datasets or datamodule.has_reference_logps(split):
                continue
            if split not in self.reference_logps:
                if not compute:
                    continue
                self.reference_logps[split] = self._reference_pass(datamodule, split)
                pairs = len(self.reference_logps[split][0])
                rank_zero_info(f"reference log-probabilities of {pairs} {split} pairs computed")
            datamodule.set_reference_logps(split, *self.reference_logps[split])

    @torch.no_grad()
    def _reference_pass(self, datamodule: Any, split: str) -> tuple[Tensor, Tensor]:
        replicas, rank = datamodule.data_parallel()
        if replicas != self.trainer.world_size:
            raise NotImplementedError(
                "Precomputing reference log-probabilities needs one data-parallel rank per process; with ranks that "
                "share rows, add ref_chosen_logps / ref_rejected_logps to the dataset first, or train a LoRA adapter."
            )
        was_training = self.model.training
        self.model.eval()
        parts = []
        # In the training step's precision (bf16-mixed: autocast), so that at step 0 the policy's log-probs equal
        # the reference's: computed in fp32 instead, every reward starts off by the bf16 rounding of a whole sequence.
        with self.trainer.precision_plugin.forward_context():
            for batch in datamodule.reference_dataloader(split, replicas, rank):
                logps, _ = self.sequence_logps(move_data_to_device(batch, self.device))
                parts.append(logps.float().view(2, -1))
        self.model.train(was_training)
        local = torch.cat(parts, dim=1)  # [2, pairs of this rank]: pair j of rank r is pair r + j * replicas
        if replicas > 1:
            local = self.all_gather(local).permute(1, 2, 0).flatten(1)
        size = len(datamodule.datasets[split])
        return local[0, :size].cpu(), local[1, :size].cpu()

    # ----------------------------------------------------------------------------------------- steps

    def setup(self, stage: str) -> None:
        """Validating a trained model (``stage="validate"``, after the datamodule's setup and before its loaders
        are built): only reference values computed before its training, kept in its checkpoint, are the
        reference's, so those are applied and none computed; without them each batch raises a clear error.
        For fit, as for CausalLMModule, each training batch is tagged with its optimizer step (how many
        micro-batches it has: fewer at the end of an epoch)."""
        context_parallel = getattr(self.trainer.strategy, "context_parallel_size", 1)
        if context_parallel > 1:  # shard_batch would refuse sequence_ids with advice that does not apply to DPO
            raise ValueError(
                f"DPOModule does not support context parallelism (ContextParallelStrategy with context_parallel_size="
                f"{context_parallel}): a pair's sequence log-probabilities are sums over whole sequences, which "
                "sequence shards do not hold. Use FSDP2Strategy (with cpu_offload, checkpointing and tiled MLP for "
                "long pairs)."
            )
        super().setup(stage)
        if stage == "validate" and self.reference_mode == "precomputed":
            self.precompute_reference_logps(compute=False)

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        window = step_window(batch, self.trainer)
        loss, metrics = self.pair_loss(batch)
        pairs = int(batch["num_pairs"])
        if self._first_loss is None:
            self._first_loss, self._first_margin = loss.detach(), metrics["rewards/margins"]
        self._last_loss, self._last_margin = loss.detach(), metrics["rewards/margins"]
        self.log("train/loss", loss.detach(), prog_bar=True, batch_size=pairs)
        for name, value in metrics.items():
            self.log(f"train/{name}", value, prog_bar=name == "rewards/margins", batch_size=pairs)
        self.log("train/tokens", self.throughput.tokens_seen_metric(), batch_size=pairs)
        if window.micro_batches < window.accumulate_grad_batches:
            # Lightning divides what this returns by accumulate_grad_batches, also in an epoch's last, shorter step:
            # there the step trains on the mean of its fewer micro-batches' means (TRL divides by those it has).
            loss = loss * (window.accumulate_grad_batches / window.micro_batches)
        return loss

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        """Each pair's values update :attr:`val_metrics` (means over every rank's pairs at the end), but for a
        repeat that evens out the ranks (:func:`~lit_memtrain.datamodules.batch.scored_rows`), which weighs 0;
        returns the batch's mean loss."""
        values = self.pair_terms(batch)
        weights = scored_rows(batch, int(batch["num_pairs"]), self.device).float()
        for name, value in values.items():
            self.val_metrics[name].update(value.detach(), weight=weights)
        return values["loss"].mean()

    def on_train_end(self) -> None:
        super().on_train_end()
        if self._first_margin is not None:
            self.print(f"reward margin: first {float(self._first_margin):.4f} -> last {float(self._last_margin):.4f}")

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint["lit_memtrain"]["reference_logps"] = dict(self.reference_logps)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        self.reference_logps = dict(checkpoint.get("lit_memtrain", {}).get("reference_logps", {}))
