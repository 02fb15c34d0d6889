"""OnlineRLModule: what every online method (GRPO, RLOO, Online DPO) does around its loss, shared by their modules.

Why a base class of its own: an online step generates completions of its prompts with the current policy, scores
them (reward functions, a trained reward model, a judge), and scores their tokens under the policy and under a
reference; only what it trains on those completions differs between the methods. Here, once, for every method:

- the reference: the model with its LoRA adapter disabled, else a frozen copy of the initial model, built in
  :meth:`~OnlineRLModule.configure_model` (sharded like the policy under FSDP2, its parameters on the host with
  ``cpu_offload``);
- generation through a backend of :mod:`lit_memtrain.models.generation`
  (:meth:`~OnlineRLModule.generation_backend_for_run`) and scoring of each rank's completions
  (:meth:`~OnlineRLModule.score_completions`, the reward functions by default);
- completion log-probabilities from the final hidden states in chunks, padding-free
  (:meth:`~OnlineRLModule.completion_logps`), never the ``[tokens, vocab]`` logits;
- gathers and sums over ranks, manual optimisation (an optimizer step every ``gradient_accumulation_steps``
  micro-batches, gradients clipped to ``max_grad_norm``, an epoch's open window closed at its end, rescaled, as the
  Hugging Face Trainer) and its schedule;
- TRL's model options: ``disable_dropout``, ``cast_lm_head_to_fp32`` (a hyper-parameter only GRPO / RLOO have),
  the synced reference (``reference_sync``) and a mixture-of-experts model's router load-balancing loss
  (:meth:`~OnlineRLModule.with_router_aux`).

A subclass's ``__init__`` sets what these read: ``sampling`` (its
:class:`~lit_memtrain.models.generation.SamplingSettings`), ``num_generations`` (``num_generations_eval`` in
validation), ``reference_sync`` (a :class:`~lit_memtrain.objectives.reference_sync.ReferenceSync` or None),
``steps_per_generation`` (slices
the no-gradient passes go in), ``reward_functions`` (None
when it overrides :meth:`~OnlineRLModule.score_completions`), ``generation_backend`` (an instance or None),
``_backend_ready``, ``_micro_steps`` and ``_reference_model`` (None), and the hyper-parameters ``beta`` (0: no
reference), ``generation_backend``, ``generation_options``, ``gather_weights_for_generation``, ``padding_free``,
``gradient_accumulation_steps``, ``max_grad_norm`` and ``disable_dropout``; and ``estimated_optimizer_steps``.
"""

from __future__ import annotations

import copy
import inspect
import math
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import replace
from typing import Any

import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor, nn

from lit_memtrain.datamodules.batch import shift_targets
from lit_memtrain.models.builder import build_training_model, load_sharded
from lit_memtrain.models.dropout import disable_dropout as disable_dropout_in_model
from lit_memtrain.models.dropout import dropout_probabilities
from lit_memtrain.models.generate import end_of_sequence_ids
from lit_memtrain.models.generation import BACKENDS, GenerationBackend, SamplingSettings
from lit_memtrain.models.lm_head_fp32 import cast_lm_head_to_fp32
from lit_memtrain.models.lora import head_weight
from lit_memtrain.models.moe import load_balancing_loss
from lit_memtrain.objectives.causal_lm import CausalLMModule
from lit_memtrain.objectives.optim import optimizer_and_schedule, scale_gradients
from lit_memtrain.objectives.policy_loss import PolicyLoss
from lit_memtrain.objectives.reward_functions import TrainerState
from lit_memtrain.objectives.rollout import Rollout, scoring_batch
from lit_memtrain.parallel.fsdp import is_sharded, run_inside_forward
from lit_memtrain.techniques.logprobs import (
    chunked_token_log_probs,
    chunked_token_log_probs_and_entropies,
    token_entropies,
    token_log_probs,
)

__all__ = ["OnlineRLModule", "callable_path", "check_generation_backend"]


class OnlineRLModule(CausalLMModule):
    """The generation, scoring, reference and optimisation of an online method's step (see the module docstring);
    subclasses (:class:`~lit_memtrain.objectives.grpo.GRPOModule`,
    :class:`~lit_memtrain.objectives.online_dpo.OnlineDPOModule`) add the loss and the step.

    Example:
        >>> class MyOnlineModule(OnlineRLModule):  # doctest: +SKIP
        ...     def training_step(self, batch, batch_idx):
        ...         rollout, rewards, truncated, logged = self._generate_and_score(batch, "a batch")
    """

    @property
    def trains_on_entropy(self) -> bool:
        """Whether the loss trains on the policy's entropy (scored with its gradient); False: logged only."""
        return False

    @property
    def scoring_temperature(self) -> float:
        """The temperature completions are scored at (the logits divided by it): the sampling one, as TRL's GRPO."""
        return self.sampling.temperature

    def score_completions(
        self, prompts: list[Any], completions: list[Any], completion_ids: list[list[int]],
        columns: dict[str, list[Any]], where: str, **extra: Any,
    ) -> Tensor:  # fmt: skip
        """``[N, K]`` scores of this rank's ``N`` completions (each after its prompt): the reward functions'."""
        return self.reward_functions(prompts, completions, completion_ids, columns, where, **extra)

    def configure_model(self) -> None:
        """Build the model (see :class:`CausalLMModule`) and, with ``beta != 0`` and no LoRA adapter, copy its initial
        weights as the frozen reference, before any checkpoint is loaded into the policy. Under a strategy with
        ``parallelize`` (FSDP2) the copy is sharded like the policy, from rank 0's weights as the policy is."""
        strategy = self._trainer.strategy if self._trainer is not None else None
        sharding = hasattr(strategy, "parallelize")
        if self.hparams.beta != 0 and self.lora is None and self._reference_model is None:
            if is_sharded(self.model):
                raise RuntimeError(
                    f"The model was sharded before {type(self).__name__} could copy its initial weights as the "
                    "reference. Let the module build it (configure_model), or train a LoRA adapter (the reference is "
                    "then the base model)."
                )
            if self.model is None and sharding:  # built unsharded first (rank 0 on the host, the others on meta)
                source_rank = strategy.global_rank == 0
                with torch.device("cpu") if source_rank else nullcontext():
                    self.model, self.recipe = build_training_model(
                        self.recipe, self.tokenizer, self.hparams.tokenizer, self._document_attention,
                        meta=not source_rank,
                    )  # fmt: skip
            elif self.model is None:
                super().configure_model()
            object.__setattr__(self, "_reference_model", copy.deepcopy(self.model).requires_grad_(False).eval())
        super().configure_model()
        reference = self._reference_model
        if sharding and reference is not None and not is_sharded(reference):
            reference = load_sharded(reference, strategy.parallelize, strategy.parameter_device, strategy.root_device)
            object.__setattr__(self, "_reference_model", reference.requires_grad_(False).eval())
        if self.hparams.disable_dropout:  # the frozen reference scores in eval mode: no dropout to disable
            disable_dropout_in_model(self.model)
        if self.hparams.get("cast_lm_head_to_fp32"):
            cast_lm_head_to_fp32(self.model)
            if self._reference_model is not None:
                cast_lm_head_to_fp32(self._reference_model)

    def setup(self, stage: str) -> None:
        """Refuse context parallelism (a completion's log-probabilities need its whole sequence). Unlike
        CausalLMModule, nothing is arranged for the step's token count: the step counts its own tokens."""
        context_parallel = getattr(self.trainer.strategy, "context_parallel_size", 1)
        if context_parallel > 1:
            raise ValueError(
                f"{type(self).__name__} does not support context parallelism (context_parallel_size="
                f"{context_parallel}): completions are generated and scored whole. Use FSDP2Strategy."
            )
        sharded_options = {"sync_ref_model": self.reference_sync is not None,
                           "cast_lm_head_to_fp32": bool(self.hparams.get("cast_lm_head_to_fp32"))}  # fmt: skip
        refused = [name for name, given in sharded_options.items() if given]
        if refused and hasattr(self.trainer.strategy, "parallelize"):
            raise ValueError(f"{refused} are not supported under FSDP2 here (the synced reference's checkpoint, the "
                             "head's own fp32 shard group): leave them False.")  # fmt: skip

    def on_fit_start(self) -> None:
        super().on_fit_start()
        if self._reference_model is not None and not is_sharded(self._reference_model):
            self._reference_model.to(self.device)
        self.generation_backend_for_run()  # a backend that cannot serve this model fails now, not mid-step
        if dropout_probabilities(self.model):
            rank_zero_info(
                f"Completions are sampled without dropout (eval mode) and trained with dropout "
                f"{dropout_probabilities(self.model)}; TRL's transformers path samples in training mode, with it. "
                "disable_dropout=True (TRL's option) trains without dropout too."
            )

    def eos_token_ids(self) -> list[int]:
        """Every token id that ends a completion: the tokenizer's end of sequence and those of the model's
        ``generation_config`` (an end-of-turn token), as TRL takes them (:func:`end_of_sequence_ids`, which
        ``lit-memtrain evaluate`` shares)."""
        return end_of_sequence_ids(self.tokenizer, self.model)

    def optimizer_steps_for(self, micro_batches_per_batch: int) -> int:
        """The run's optimizer steps when each training batch takes ``micro_batches_per_batch`` micro-batches:
        ``max_steps``, else per epoch its micro-batches over ``gradient_accumulation_steps``, the epoch's last,
        shorter window included (:meth:`_close_window_at_epoch_end`)."""
        trainer = self.trainer
        if trainer.max_steps > 0:
            return trainer.max_steps
        micro_batches = trainer.estimated_stepping_batches * micro_batches_per_batch
        accumulation = self.hparams.gradient_accumulation_steps
        per_epoch, epochs = trainer.num_training_batches, trainer.max_epochs  # set by estimated_stepping_batches
        if math.isfinite(per_epoch) and epochs is not None and epochs > 0:
            return max(1, math.ceil(per_epoch * micro_batches_per_batch / accumulation) * epochs)
        return max(1, int(micro_batches / accumulation))

    def configure_optimizers(self) -> dict[str, Any]:
        """As :class:`CausalLMModule`'s, the schedule spanning the run's optimizer steps
        (:meth:`estimated_optimizer_steps`): a batch takes several, or a fraction of one."""
        hp = self.hparams
        config = optimizer_and_schedule(
            self.named_parameters(), learning_rate=hp.learning_rate, weight_decay=hp.weight_decay, betas=hp.betas,
            warmup=hp.warmup, min_lr_ratio=hp.min_lr_ratio, optimizer=hp.optimizer, lr_scheduler=hp.lr_scheduler,
            stepping_batches=self.estimated_optimizer_steps,
            scaler_clips_gradients=lambda: (
                getattr(self.trainer.precision_plugin, "scaler", None) is not None and hp.max_grad_norm is not None
            ),
        )  # fmt: skip
        if isinstance(config["lr_scheduler"]["scheduler"], torch.optim.lr_scheduler.ReduceLROnPlateau):
            raise ValueError(
                f"{type(self).__name__} steps its schedule after every optimizer step, inside the training step; "
                "ReduceLROnPlateau needs a monitored metric there is none of. Use a schedule stepped by steps."
            )
        return config

    # ----------------------------------------------------------------------------------- log-probs

    def completion_logps(self, rollout: Rollout, model: nn.Module | None = None) -> Tensor:
        """``[N, width]`` log-probabilities of ``rollout``'s completion tokens at the sampling temperature, under
        ``model`` (the policy by default), 0 off the completion mask."""
        return self._score_completions(rollout, self.model if model is None else model, with_entropy=False)[0]

    def completion_logps_and_entropies(self, rollout: Rollout) -> tuple[Tensor, Tensor, Tensor | None]:
        """:meth:`completion_logps` under the policy, the entropy (nats; with its gradient where
        :attr:`trains_on_entropy`) of the policy's distribution at each of those tokens at the sampling temperature
        (TRL's ``entropy``), 0 off the mask, and a mixture-of-experts model's router load-balancing loss of that
        forward (None without one, or at weight 0)."""
        logps, entropy, router_aux = self._score_completions(rollout, self.model, with_entropy=True)
        assert entropy is not None
        return logps, entropy, router_aux

    def with_router_aux(self, out: PolicyLoss, router_aux: Tensor | None) -> PolicyLoss:
        """``out`` with the router load-balancing loss added as TRL adds it: ``router_aux_loss_coef * aux``, divided
        by ``gradient_accumulation_steps`` like the micro-batch's policy loss."""
        if router_aux is None:
            return out
        weight = self.router_aux_weight() / self.hparams.gradient_accumulation_steps
        return replace(out, loss=out.loss + weight * router_aux.to(out.loss.device), router_aux=router_aux.detach())

    def _score_completions(
        self, rollout: Rollout, model: nn.Module, with_entropy: bool
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        batch, positions = scoring_batch(rollout, self.tokenizer.pad_token_id, self.hparams.padding_free)
        batch = move_data_to_device(batch, self.device)
        self.run_setup_probes(batch)  # the policy's, once: the reference shares its architecture and attention
        if torch.is_grad_enabled():  # a trained slice: what the throughput counts
            self.throughput.count(batch, self.trainer.world_size, self.device, self.trainer.strategy.reduce)
        targets = shift_targets(batch["labels"]).flatten()
        temperature = self.scoring_temperature
        routed = with_entropy and bool(self.router_aux_weight())  # the policy's training forward of a MoE model
        if self.hparams.loss_type == "nll":
            outputs = model(**self._model_inputs(batch), **({"output_router_logits": True} if routed else {}))
            logits = outputs.logits.flatten(0, 1) / temperature
            row = token_log_probs(logits, targets)
            chunk_size = self.hparams.loss_chunk_size
            with_grad = self.trains_on_entropy and torch.is_grad_enabled()  # an entropy bonus trains on it
            entropy = None
            if with_entropy:
                entropy = token_entropies(logits, targets, chunk_size=chunk_size, with_grad=with_grad)
            router_aux = outputs.aux_loss if routed else None
        elif is_sharded(model):
            scores = run_inside_forward(
                model, self._chunked_logps, model, batch, targets, temperature, with_entropy, routed
            )
            row, entropy, router_aux = scores
        else:
            row, entropy, router_aux = self._chunked_logps(model, batch, targets, temperature, with_entropy, routed)
        mask, at = rollout.completion_mask().to(row.device), positions.to(row.device)
        return row[at] * mask, (entropy[at] * mask if with_entropy else None), router_aux

    def _chunked_logps(
        self,
        model: nn.Module,
        batch: dict[str, Any],
        targets: Tensor,
        temperature: float,
        with_entropy: bool,
        routed: bool = False,
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """Token log-probabilities of a batch's targets from ``model``'s final hidden states, in chunks, (with
        ``with_entropy``) the entropy at each, and (``routed``) the router load-balancing loss of the forward.

        TRL divides the logits by the temperature after the model's own transform (scale, soft-cap); without a
        soft-cap that is a scale of ``scale / temperature``. With one, only ``temperature == 1`` can be chunked."""
        transform = self.setup_probes.logit_transform
        if transform.softcap is not None and temperature != 1:
            raise ValueError(
                f"The model soft-caps its logits (final_logit_softcapping={transform.softcap}) and temperature="
                f"{temperature}: the chunked log-probabilities cannot divide capped logits by the temperature. Use "
                "loss_type='nll' (the model's logits) or temperature=1."
            )
        outputs = model.get_decoder()(**self._model_inputs(batch), **({"output_router_logits": True} if routed else {}))
        router_aux = load_balancing_loss(model, outputs.router_logits, batch.get("attention_mask")) if routed else None
        hidden = outputs.last_hidden_state.flatten(0, 1)
        fp32_head = bool(self.hparams.get("cast_lm_head_to_fp32"))
        hidden = hidden.float() if fp32_head else hidden
        weight, bias = head_weight(model.get_output_embeddings())
        bias = bias.to(hidden.dtype) if bias is not None else None  # a LoRA head keeps fp32 adapters on a bf16 base
        arguments = (hidden, weight.to(hidden.dtype), targets, self.hparams.loss_chunk_size, transform.softcap, bias,
                     transform.scale / temperature)  # fmt: skip
        with torch.autocast(hidden.device.type, enabled=False) if fp32_head else nullcontext():
            if with_entropy:
                return *chunked_token_log_probs_and_entropies(*arguments), router_aux
            return chunked_token_log_probs(*arguments), None, router_aux

    @torch.no_grad()
    def _no_grad_logps(self, rollout: Rollout, model: nn.Module | None = None) -> Tensor:
        """:meth:`completion_logps` without gradients, one training slice at a time (the memory of one micro-batch)."""
        parts = rollout.split(self.steps_per_generation)
        return torch.cat([self.completion_logps(part, model) for part in parts])

    def reference_logps(self, rollout: Rollout) -> Tensor:
        """The reference's ``[N, width]`` log-probabilities: the model with its LoRA adapter disabled, or the frozen
        copy of its initial weights."""
        if self.lora is not None:
            with self.model.disable_adapter():
                return self._no_grad_logps(rollout)
        return self._no_grad_logps(rollout, self._reference_model)

    # ----------------------------------------------------------------------------------- rollouts

    def _gather_rows(self, tensor: Tensor) -> Tensor:
        """Every rank's ``[n, ...]`` rows, rank after rank: ``[world * n, ...]``."""
        tensor = tensor.to(self.device)
        if self.trainer.world_size == 1:
            return tensor
        return self.all_gather(tensor).flatten(0, 1)

    def _sum_over_ranks(self, tensor: Tensor) -> Tensor:
        return self.trainer.strategy.reduce(tensor.to(self.device), reduce_op="sum")

    def generation_backend_for_run(self) -> GenerationBackend:
        """The generation backend, built and set up (:meth:`GenerationBackend.setup`) on first use from
        ``generation_backend`` and ``generation_options`` unless an instance was given."""
        if self.generation_backend is None:
            backend_class = BACKENDS[self.hparams.generation_backend]
            options = dict(self.hparams.generation_options or {})
            if "gather_weights" in inspect.signature(backend_class.__init__).parameters:
                options.setdefault("gather_weights", self.hparams.gather_weights_for_generation)
            self.generation_backend = backend_class(
                self.sampling, self.eos_token_ids(), self.tokenizer.pad_token_id, **options
            )
        if not self._backend_ready:
            self.generation_backend.setup(self.model)
            self._backend_ready = True
        return self.generation_backend

    def _generate_and_score(
        self, batch: dict[str, Any], where: str
    ) -> tuple[Rollout, Tensor, Tensor, dict[str, list[float]]]:
        """:meth:`generate_rollout` on this rank alone, no collective (validation calls it with however many prompts
        the rank holds): the rollout, its rewards ``[N, K]``, which completions were truncated ``[N]`` and what the
        reward functions logged."""
        prompts, prompt_ids, columns = batch["prompt"], batch["prompt_ids"], batch.get("columns", {})
        generations = self.num_generations if self.training else self.num_generations_eval
        backend = self.generation_backend_for_run()
        completion_ids = backend.generate(self.model, prompt_ids, generations, self.device, self.trainer.global_step)
        if len(completion_ids) != len(prompt_ids) * generations:
            raise RuntimeError(
                f"The generation backend {type(backend).__name__} returned {len(completion_ids)} completions for "
                f"{len(prompt_ids)} prompts x num_generations={generations} on {where}."
            )

        def repeat(values: Sequence[Any]) -> list[Any]:
            return [value for value in values for _ in range(generations)]

        texts = self.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        conversational = bool(prompts) and isinstance(prompts[0], list)
        completions = [[{"role": "assistant", "content": text}] for text in texts] if conversational else texts
        logged: dict[str, list[float]] = {}
        extras: dict[str, list[Any]] = {}
        rewards = self.score_completions(
            repeat(prompts), completions, completion_ids, {name: repeat(v) for name, v in columns.items()}, where,
            trainer_state=TrainerState.of(self.trainer),
            log_metric=lambda name, value: logged.setdefault(name, []).append(float(value)),
            log_extra=lambda column, values: extras.setdefault(column, []).extend(values),
        )  # fmt: skip
        self.completion_extras = extras  # what reward functions gave log_extra, last batch
        ends = {*backend.eos_token_ids, self.tokenizer.pad_token_id}
        truncated = torch.tensor([not ids or ids[-1] not in ends for ids in completion_ids])
        trained = ~truncated if self.hparams.get("mask_truncated_completions") else torch.ones_like(truncated)
        rollout = Rollout.of(repeat(prompt_ids), completion_ids, trained)
        if backend.sampling_logprobs is not None:
            rollout = rollout.with_sampling_logps(backend.sampling_logprobs)
        return rollout, rewards, truncated, logged

    def _optimizer_step(self, optimizer: Any) -> None:
        if self.hparams.max_grad_norm is not None:
            self.clip_gradients(optimizer, gradient_clip_val=self.hparams.max_grad_norm, gradient_clip_algorithm="norm")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if self.reference_sync is not None:
            self.reference_sync.after_step(self.model, self._reference_model, self.trainer.global_step)
        scheduler = self.lr_schedulers()
        if scheduler is not None:
            scheduler.step()

    def _close_window_at_epoch_end(self, optimizer: Any, batch_idx: int) -> None:
        """After an epoch's last batch, step on the micro-batches of a window left open, their gradients rescaled
        to the mean over them, as the Hugging Face Trainer closes an epoch's last, shorter window (TRL divides the
        loss by its ``current_gradient_accumulation_steps``); the next epoch starts a new window."""
        accumulation = self.hparams.gradient_accumulation_steps
        open_steps = self._micro_steps % accumulation
        last = self.trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
        if open_steps and (last or batch_idx + 1 >= self.trainer.num_training_batches):
            scale_gradients(self.parameters(), accumulation / open_steps)
            self._optimizer_step(optimizer)
            self._micro_steps += accumulation - open_steps

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """A prompt batch holds no trained tokens: the step counts the batches it scores itself."""

    def on_validation_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        """Probes run on the batches the step scores (prompts alone have no documents to probe)."""

    @property
    def accumulation_window_open(self) -> bool:
        """Whether micro-batches have been trained since the last optimizer step (their gradients wait for the
        next). A window crosses training batches when ``gradient_accumulation_steps`` is not a multiple of the
        micro-batches of one batch (GRPO's ``steps_per_generation * num_iterations``): a batch may then end after an
        optimizer step with the next window already open. Those gradients are in no checkpoint, so a fit resumed
        from one saved now would take that step without them; :class:`~lit_memtrain.callbacks.SigtermCheckpoint`
        reads this to stop only once the window is closed."""
        return self._micro_steps % self.hparams.gradient_accumulation_steps != 0

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        if self.accumulation_window_open:
            open_steps = self._micro_steps % self.hparams.gradient_accumulation_steps
            rank_zero_warn(
                f"A checkpoint is being saved at step {self.trainer.global_step} with {open_steps} micro-batch(es) of "
                f"the next optimizer step already trained (gradient_accumulation_steps="
                f"{self.hparams.gradient_accumulation_steps} is not a multiple of the micro-batches of a training "
                "batch): their gradients are not saved, so a fit resumed from it takes that step without them and "
                "differs from the uninterrupted fit. Make gradient_accumulation_steps a multiple of the micro-batches "
                "of a batch, or resume from a checkpoint saved with the window closed."
            )
        checkpoint["lit_memtrain"]["micro_steps"] = self._micro_steps
        if self.reference_sync is not None:  # no longer the initial weights configure_model copies
            checkpoint["lit_memtrain"]["reference"] = self._reference_model.state_dict()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        self._micro_steps = int(checkpoint.get("lit_memtrain", {}).get("micro_steps", 0))
        if self.reference_sync is not None:
            if "reference" not in checkpoint.get("lit_memtrain", {}):
                raise ValueError("The checkpoint has no synced reference (saved without sync_ref_model=True).")
            self._reference_model.load_state_dict(checkpoint["lit_memtrain"]["reference"])


def check_generation_backend(
    backend: str | GenerationBackend, options: dict[str, Any] | None, sampling: SamplingSettings
) -> None:
    """Refuse a generation backend that cannot run as configured, before any work: an unknown name, options its
    class does not take, a package it needs missing (vLLM), sampling settings it would draw differently."""
    if isinstance(backend, GenerationBackend):
        if options:
            raise ValueError(
                "generation_options apply to a backend given by name; a GenerationBackend instance is already built "
                f"with its options, got {sorted(options)}."
            )
        type(backend).check_sampling(sampling)
        return
    if backend not in BACKENDS:
        raise ValueError(
            f"generation_backend must be one of {sorted(BACKENDS)} or a GenerationBackend instance, got {backend!r}."
        )
    if options is not None and not isinstance(options, dict):
        raise TypeError(f"generation_options must be a dict of the backend's options, got {options!r}.")
    backend_class = BACKENDS[backend]
    backend_class.check_available()
    backend_class.check_options(options or {})
    backend_class.check_sampling(sampling)


def callable_path(function: Callable[..., Any]) -> str:
    """Where ``function`` is imported from (``module.name``); a callable object (a reward model) cannot be imported
    back, so it is described instead, and loading such hyper-parameters asks for it to be passed again."""
    if not hasattr(function, "__qualname__"):
        return f"<a {type(function).__name__} object: pass it again as reward_funcs>"
    return f"{function.__module__}.{function.__qualname__}"


