"""RewardModule: a reward model (one score per sequence) trained on preference pairs, as TRL's ``RewardTrainer``.

Why a subclass of :class:`~lit_memtrain.objectives.causal_lm.CausalLMModule`: model building (hub, local path,
preset, LoRA, the attention choice and its probes, dtype), the sharded build and root-forward under
:class:`~lit_memtrain.strategies.FSDP2Strategy`, the optimizer and schedule, throughput, exports and checkpoints are
the same; the recipe's ``task="reward"`` builds the decoder under a one-output score head
(``AutoModelForSequenceClassification``) and PEFT keeps that head trainable. Every memory callback acts on the
decoder layers and composes unchanged.

One step: the decoder runs once over all ``2 B`` sequences of a batch (right-padded rows, or padding-free: one row,
documents kept apart), and the score head is applied to the final hidden state at each sequence's reward token only
(:func:`~lit_memtrain.objectives.reward_loss.last_token_positions`: the rightmost token that is not the pad token,
as transformers reads it), never to every token. The rewards enter TRL's Bradley-Terry loss
(:mod:`~lit_memtrain.objectives.reward_loss`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import replace
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn
from torchmetrics import MaxMetric, MeanMetric, MinMetric

from lit_memtrain.datamodules.batch import scored_rows
from lit_memtrain.datamodules.preference_collate import MARGIN_COLUMN, REFERENCE_COLUMNS
from lit_memtrain.models.dropout import disable_dropout
from lit_memtrain.objectives.causal_lm import CausalLMModule
from lit_memtrain.objectives.reward_loss import (
    PAIR_MEANS,
    bradley_terry_losses,
    last_token_positions,
    metrics_from_statistics,
    pair_values,
    step_statistics,
)
from lit_memtrain.objectives.step_tokens import step_window

__all__ = ["RewardModule"]

_PAIR_KEYS = ("sequence_ids", "num_pairs", *REFERENCE_COLUMNS)  # batch keys the decoder does not take
_PROBE_LENGTHS = (7, 5)
_RECENT_STEPS = 10  # the final accuracy printed is their mean: one micro-batch's pairs are too few to tell


class RewardModule(CausalLMModule):
    """Train a reward model on preference pairs with TRL's Bradley-Terry loss.

    Args:
        center_rewards_coefficient: TRL's: adds ``c * mean((r_chosen + r_rejected)^2)`` to the loss so that rewards
            stay centred on zero (TRL advises 0.01); ``None``: no such term.
        disable_dropout: TRL's (default True): set every dropout probability to 0 once the model is built, a LoRA
            adapter's own (``lora.dropout``) included, as TRL's ``RewardTrainer`` does after PEFT wraps the model.
        **kwargs: every argument of :class:`~lit_memtrain.objectives.causal_lm.CausalLMModule` (model, preset,
            config_overrides, tokenizer, dtype, attn_implementation, lora, learning_rate, ...). ``model`` may be a
            causal LM checkpoint: its decoder is loaded under a new, randomly initialised score head. With ``lora``
            the score head trains whole (PEFT's ``modules_to_save``, as TRL advises); ``lora.lm_head`` does not apply.
            ``loss_type``, ``loss_chunk_size`` and ``router_aux_loss_coef`` are about an LM head's token loss and
            have no effect here (a mixture-of-experts model is refused at fit start unless the coefficient is 0).
            The learning rate keeps CausalLMModule's default (2e-5); TRL's RewardConfig defaults to 1e-4.

    The data: :class:`~lit_memtrain.datamodules.preference.PreferenceDataModule` pairs (TRL's preference formats:
    explicit or implicit prompt, strings or chat messages; strings get the eos appended), with
    ``long_pairs="drop"``: a pair with a sequence longer than ``max_length`` is dropped, as TRL drops it, rather than
    cut (a cut sequence would lose the token its reward is read at; any other setting is refused at setup). A
    ``margin`` column is subtracted from each pair's reward gap, as in TRL.

    The reward token is each sequence's rightmost token that is not the tokenizer's pad token, the position
    transformers' sequence classification reads and an export is scored at: with a tokenizer whose pad token is its
    eos token (TRL's fallback when it has none), the eos appended to each sequence counts as padding and the reward
    is read at the token before it, in padded and padding-free batches alike (TRL's behaviour; said in the log).

    Logged (``train/`` and ``val/``): ``loss``, ``accuracy`` (the share of pairs with ``r_chosen > r_rejected``),
    ``margin`` (mean ``r_chosen - r_rejected``), ``rewards/chosen``, ``rewards/rejected``, ``mean_reward``,
    ``min_reward``, ``max_reward``, over every rank's pairs (each pair weighing the same: a step's values in one
    gather over the ranks, validation's over the whole validation set). The training loss is the mean over each
    micro-batch's pairs; with gradient accumulation a step trains on the mean of its micro-batches' means, as in TRL.

    Example:
        >>> module = RewardModule(preset="tiny-qwen3", tokenizer="lit-memtrain/embedded")
        >>> data = PreferenceDataModule(max_length=64, long_pairs="drop")  # doctest: +SKIP
        >>> Trainer(max_steps=20).fit(module, datamodule=data)  # doctest: +SKIP
    """

    def __init__(
        self, center_rewards_coefficient: float | None = None, disable_dropout: bool = True, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        if center_rewards_coefficient is not None and not center_rewards_coefficient >= 0:
            raise ValueError(
                f"center_rewards_coefficient must be >= 0 (TRL advises 0.01) or None, got {center_rewards_coefficient}."
            )
        self.recipe = replace(self.recipe, task="reward")
        self.val_metrics = nn.ModuleDict(
            {
                **{name: MeanMetric() for name in ("loss", *PAIR_MEANS, "mean_reward")},
                "min_reward": MinMetric(),
                "max_reward": MaxMetric(),
            }
        )
        self._score_reading_checked = False
        self._first_accuracy: Tensor | None = None
        self._recent_accuracy: deque[Tensor] = deque(maxlen=_RECENT_STEPS)

    # ------------------------------------------------------------------------------------------ model

    def configure_model(self) -> None:
        super().configure_model()
        if self.hparams.disable_dropout:
            disable_dropout(self.model)

    def run_setup_probes(self, batch: dict[str, Any] | None = None) -> None:
        """The probe a padding-free batch needs (packed documents stay apart, on the decoder's hidden states); a
        reward model has no LM head, so no chunked-loss probe."""
        self.setup_probes.run(self.model, False, batch, self._model_inputs)

    @property
    def pad_token_id(self) -> int:
        """The id the reward token is read past (the model config's, set from the tokenizer when it is built)."""
        return self.model.config.get_text_config().pad_token_id

    # ------------------------------------------------------------------------------------------- step

    def sequence_rewards(self, batch: dict[str, Any]) -> Tensor:
        """The rewards of the batch's ``2 B`` sequences (chosen ones first), ``[2 B]``: the score head applied to
        the decoder's final hidden state at each sequence's reward token."""
        self.run_setup_probes(batch)
        model_batch = {key: value for key, value in batch.items() if key not in _PAIR_KEYS}
        sequences = 2 * int(batch["num_pairs"])
        return self._in_root_forward(self._score_sequences, model_batch, batch["sequence_ids"], sequences)

    def _score_sequences(self, batch: dict[str, Any], sequence_ids: Tensor, sequences: int) -> Tensor:
        hidden = self.model.get_decoder()(**self._model_inputs(batch)).last_hidden_state.flatten(0, 1)
        positions = last_token_positions(batch["input_ids"], sequence_ids, sequences, self.pad_token_id)
        return self._score_head()(hidden[positions]).squeeze(-1)

    def _score_head(self) -> nn.Module:
        head = getattr(self.model, "score", None)
        if not isinstance(head, nn.Module):
            raise ValueError(
                f"{type(self.model).__name__} has no 'score' head: RewardModule reads rewards through the score head "
                "of transformers' *ForSequenceClassification models. Use a model family that has one."
            )
        return head

    def pair_losses(self, batch: dict[str, Any]) -> tuple[Tensor, Tensor, Tensor]:
        """Each pair's Bradley-Terry loss, and its chosen and rejected rewards (``[B]`` each, the rewards detached,
        in fp32)."""
        rewards = self.sequence_rewards(batch).float()
        chosen, rejected = rewards.chunk(2)
        margin, coefficient = batch.get(MARGIN_COLUMN), self.hparams.center_rewards_coefficient
        return bradley_terry_losses(chosen, rejected, margin, coefficient), chosen.detach(), rejected.detach()

    def pair_loss(self, batch: dict[str, Any]) -> tuple[Tensor, Tensor, Tensor]:
        """Mean Bradley-Terry loss over the batch's pairs, and their chosen and rejected rewards (``[B]`` each,
        detached, in fp32)."""
        losses, chosen, rejected = self.pair_losses(batch)
        return losses.mean(), chosen, rejected

    def compute_loss(self, batch: dict[str, Any], num_items: int | Tensor | None = None) -> Tensor:
        """The mean Bradley-Terry loss over the batch's pairs (a reward model has no token loss: ``num_items``,
        a count of target tokens, does not apply)."""
        if num_items is not None:
            raise ValueError("RewardModule's loss is a mean over pairs: num_items (target tokens) does not apply.")
        return self.pair_loss(batch)[0]

    # --------------------------------------------------------------------------------------- checks

    def setup(self, stage: str) -> None:
        """Refuse what would train on other sequences than TRL's: context parallelism (a sequence's reward token
        would sit on one shard), and preference data that cuts sequences at ``max_length``."""
        context_parallel = getattr(self.trainer.strategy, "context_parallel_size", 1)
        if context_parallel > 1:
            raise ValueError(
                f"RewardModule does not support context parallelism (context_parallel_size={context_parallel}): a "
                "sequence's reward is read at its last token, which one sequence shard holds. Use FSDP2Strategy "
                "(with cpu_offload, checkpointing and tiled MLP for long pairs)."
            )
        datamodule = self.trainer.datamodule
        if getattr(datamodule, "long_pairs", "drop") != "drop":
            raise ValueError(
                f"{type(datamodule).__name__}(long_pairs={datamodule.long_pairs!r}) cuts sequences longer than "
                "max_length at their end, where a reward model reads its score. Set long_pairs='drop' (data."
                "long_pairs: drop): pairs with a sequence over max_length are dropped, as TRL's RewardTrainer drops "
                "them."
            )
        super().setup(stage)

    def on_fit_start(self) -> None:
        super().on_fit_start()
        if self.router_aux_weight():
            raise ValueError(
                f"{type(self.model).__name__} has routers: RewardModule does not add the router load-balancing loss. "
                "Set router_aux_loss_coef=0 to train it without that loss."
            )
        self._check_reward_reading()

    def on_validation_start(self) -> None:
        super().on_validation_start()
        self._check_reward_reading()

    @torch.no_grad()
    def _check_reward_reading(self) -> None:
        """Once: the data's pad token is the model's, and :meth:`sequence_rewards` equals the model's own forward on
        two right-padded sequences (the decoder, the score head and the position are the ones it uses); said in the
        log.

        Raises:
            ValueError: either differs: the rewards would be read at other positions than an export reads them.
        """
        if self._score_reading_checked:
            return
        pad = self.pad_token_id
        tokenizer = getattr(self._trainer.datamodule, "tokenizer", None) if self._trainer is not None else None
        if tokenizer is not None and tokenizer.pad_token_id != pad:
            raise ValueError(
                f"The data is padded with token id {tokenizer.pad_token_id} but the reward model reads past pad token "
                f"id {pad}: give the module and the data the same tokenizer (lit-memtrain fit links data.tokenizer)."
            )
        width, device = max(_PROBE_LENGTHS), self.model.get_input_embeddings().weight.device
        vocab = self.model.get_input_embeddings().num_embeddings
        ids = torch.randint(0, vocab, (len(_PROBE_LENGTHS), width), generator=torch.Generator().manual_seed(0))
        ids[ids == pad] = (pad + 1) % vocab
        real = torch.arange(width)[None] < torch.tensor(_PROBE_LENGTHS)[:, None]
        ids[~real] = pad
        owners = torch.arange(len(_PROBE_LENGTHS))[:, None].expand_as(ids).masked_fill(~real, len(_PROBE_LENGTHS))
        batch = {"input_ids": ids, "attention_mask": real.long(), "sequence_ids": owners, "num_pairs": 1}
        batch = {key: value.to(device) if isinstance(value, Tensor) else value for key, value in batch.items()}
        training = self.model.training
        self.model.eval()
        try:
            ours = self.sequence_rewards(batch).float()
            theirs = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)
        finally:
            self.model.train(training)
        expected = theirs.logits[:, 0].float()
        full_precision = self.model.get_input_embeddings().weight.dtype in (torch.float32, torch.float64)
        if not torch.allclose(ours, expected, rtol=1e-4 if full_precision else 3e-2, atol=1e-5):
            raise ValueError(
                f"RewardModule's rewards {ours.tolist()} differ from {type(self.model).__name__}'s own forward "
                f"{expected.tolist()} on the same padded sequences: this model reads its score otherwise than at the "
                "last non-pad token through its 'score' head, which RewardModule assumes."
            )
        name = tokenizer.convert_ids_to_tokens(pad) if tokenizer is not None else None
        note = f"rewards read at each sequence's last token that is not the pad token {name!r} (id {pad})"
        eos = self.model.config.get_text_config().eos_token_id
        if pad == eos or (isinstance(eos, list) and pad in eos):
            note += (
                "; the pad token is the eos token, so a trailing eos counts as padding and the reward is read at the "
                "token before it (as TRL and transformers read it)"
            )
        rank_zero_info(note)
        self._score_reading_checked = True

    # ---------------------------------------------------------------------------------- train and val

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        window = step_window(batch, self.trainer)
        loss, chosen, rejected = self.pair_loss(batch)
        statistics = self.all_gather(step_statistics(loss.detach(), chosen, rejected))  # one gather for all metrics
        metrics = metrics_from_statistics(statistics)
        if self._first_loss is None:  # kept on the device: reading them now would wait for the step to finish
            self._first_loss, self._first_accuracy = metrics["loss"], metrics["accuracy"]
        self._last_loss = metrics["loss"]
        self._recent_accuracy.append(metrics["accuracy"])
        pairs = int(batch["num_pairs"])
        for name, value in metrics.items():
            self.log(f"train/{name}", value, prog_bar=name in ("loss", "accuracy"), batch_size=pairs)
        self.log("train/tokens", self.throughput.tokens_seen_metric(), batch_size=pairs)
        if window.micro_batches < window.accumulate_grad_batches:
            # Lightning divides what this returns by accumulate_grad_batches, also in an epoch's last, shorter step:
            # there the step trains on the mean of its fewer micro-batches' means (TRL divides by those it has).
            loss = loss * (window.accumulate_grad_batches / window.micro_batches)
        return loss

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        """Each pair's values update :attr:`val_metrics` (over every rank's pairs at the end), but for a repeat
        that evens out the ranks (:func:`~lit_memtrain.datamodules.batch.scored_rows`), which weighs 0; returns the
        batch's mean loss."""
        losses, chosen, rejected = self.pair_losses(batch)
        scored = scored_rows(batch, chosen.numel(), chosen.device)
        weights = scored.float()
        metrics = self.val_metrics
        metrics["loss"].update(losses.detach(), weight=weights)
        for name, values in pair_values(chosen, rejected).items():
            metrics[name].update(values, weight=weights)
        rewards, scored = torch.cat([chosen, rejected]), torch.cat([scored, scored])
        metrics["mean_reward"].update(rewards, weight=scored.float())
        metrics["min_reward"].update(rewards.masked_fill(~scored, torch.inf))  # a repeat's rewards reach neither end
        metrics["max_reward"].update(rewards.masked_fill(~scored, -torch.inf))
        return losses.detach().mean()

    def on_train_end(self) -> None:
        super().on_train_end()
        if self._first_accuracy is not None:
            recent = float(torch.stack(list(self._recent_accuracy)).mean())
            self.print(
                f"reward accuracy: first {float(self._first_accuracy):.4f} -> last {recent:.4f} (mean of the last "
                f"{len(self._recent_accuracy)} micro-batches)"
            )
