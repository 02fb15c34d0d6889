"""GRPOModule: online RL (GRPO and its DAPO, Dr. GRPO, BNPO losses) with the model path and memory techniques of SFT.

Why a subclass of :class:`~lit_memtrain.objectives.causal_lm.CausalLMModule`: model building (presets, hub, LoRA /
QLoRA, attention and its probes), the sharded build and root-forward under
:class:`~lit_memtrain.strategies.FSDP2Strategy`, the optimizer and schedule, throughput, exports and checkpoints
are the same; the memory callbacks act on the model and compose unchanged. What differs is the step.

One training step (one batch of ``P`` prompts on each rank) is TRL's generation cycle:

1. **Generate** ``num_generations`` (``G``) completions per prompt with the generation backend
   (:mod:`lit_memtrain.models.generation`; Hugging Face ``generate`` by default: eval mode, no gradients, KV cache).
2. **Score** them with the reward functions (TRL's signature, :mod:`~lit_memtrain.objectives.reward_functions`),
   gather the rewards of every rank and turn them into advantages (:mod:`~lit_memtrain.objectives.advantages`).
3. Without gradients, the log-probabilities of the sampling policy (only when training goes off-policy) and of
   the reference (``beta != 0``): the same model with its LoRA adapter disabled, else a frozen copy of the initial
   model (sharded like the policy under FSDP2, its parameters on the host with ``cpu_offload``).
4. **Train** ``num_iterations`` times over the ``P * G`` completions, in ``steps_per_generation`` shuffled slices,
   an optimizer step every ``gradient_accumulation_steps`` slices (manual optimisation: Lightning's automatic
   optimisation takes one optimizer step per ``training_step``). Each slice is one padding-free row of prompt +
   completion documents; its completion tokens' log-probabilities come from the final hidden states in chunks
   (:func:`~lit_memtrain.techniques.logprobs.chunked_token_log_probs`, at the sampling ``temperature``), never the
   ``[tokens, vocab]`` logits, and enter TRL's clipped loss (:mod:`~lit_memtrain.objectives.policy_loss`).

``trainer.global_step`` counts optimizer steps (``max_steps`` too: a batch whose step reaches it trains no further
slice, as the Hugging Face Trainer stops after that optimizer step). A batch counts
prompts: each rank draws ``G`` completions of each of its prompts, so a group never spans ranks.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor, nn
from torchmetrics import MeanMetric

from lit_memtrain.datamodules.batch import scored_rows
from lit_memtrain.models.generation import GenerationBackend, SamplingSettings
from lit_memtrain.objectives.advantages import (
    SCALE_REWARDS,
    ScaleRewards,
    combine_rewards,
    group_relative_advantages,
    nanstd,
    normalize_then_sum_advantages,
)
from lit_memtrain.objectives.online_rl import OnlineRLModule, callable_path, check_generation_backend
from lit_memtrain.objectives.entropy_bonus import EntropyBonus
from lit_memtrain.objectives.grpo_options import ImportanceSamplingLevel, PolicyLossOptions, check_loss_combination
from lit_memtrain.objectives.grpo_options import check_multi_objective_aggregation
from lit_memtrain.objectives.policy_loss import LOSS_TYPES, PolicyLoss, PolicyLossType, clipped_policy_loss
from lit_memtrain.objectives.policy_loss import high_entropy_mask
from lit_memtrain.objectives.ragged_gather import every_rank_values
from lit_memtrain.objectives.reference_sync import ReferenceSync
from lit_memtrain.objectives.reward_functions import RewardFunctions
from lit_memtrain.objectives.rollout import Rollout
from lit_memtrain.objectives.sampling_correction import SamplingCorrection, SamplingCorrectionMode
from lit_memtrain.objectives.trl_config_fields import refuse_trl_fields

__all__ = ["GRPOModule"]


@dataclass
class _StepStats:
    """What a step's micro-batches add up for the log (this rank's sums; reduced over ranks at the end)."""

    losses: list[Tensor] = field(default_factory=list)
    counted: list[Tensor] = field(default_factory=list)  # tokens (GRPO) or completions (RLOO) the flags count over
    low: list[Tensor] = field(default_factory=list)
    high: list[Tensor] = field(default_factory=list)
    kl: list[Tensor] = field(default_factory=list)
    low_per_completion: list[Tensor] = field(default_factory=list)
    high_per_completion: list[Tensor] = field(default_factory=list)
    entropy: list[Tensor] = field(default_factory=list)  # the policy's entropy summed over the trained tokens
    entropy_tokens: list[Tensor] = field(default_factory=list)
    policy_losses: list[Tensor] = field(default_factory=list)  # the loss without the entropy bonus, when it has one
    means: dict[str, list[Tensor]] = field(default_factory=dict)  # name -> [sum, count] per micro-batch (PolicyLoss)
    router_aux: list[Tensor] = field(default_factory=list)  # a mixture-of-experts model's, per micro-batch


def _check_positive_int(name: str, value: Any, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}.")


class GRPOModule(OnlineRLModule):
    """Train a causal LM with GRPO on prompts, from the rewards of its own completions.

    Args:
        reward_funcs: reward functions with TRL's signature ``f(prompts, completions, completion_ids, **columns)
            -> list[float | None]``, or import paths to them (how a YAML config names them).
        reward_weights: one weight per reward function (default 1.0 each); the reward is their weighted sum.
        num_generations: completions per prompt (``G``, at least 2: advantages compare them).
        num_generations_eval: TRL's: completions per validation prompt (default: ``num_generations``; 1 is enough:
            validation computes no advantage).
        max_completion_length, temperature, top_p, top_k, min_p, repetition_penalty, do_sample, generation_kwargs
            (TRL's: further arguments of the backend's sampling): how completions are drawn
            (:class:`~lit_memtrain.models.generation.SamplingSettings`); the loss scores them at the same
            ``temperature``.
        generation_backend: a name of :data:`~lit_memtrain.models.generation.BACKENDS`: ``"transformers"``
            (Hugging Face ``generate``, the default), ``"transformers_continuous"`` (continuous batching),
            ``"vllm_colocate"`` or ``"vllm_server"`` (vLLM, an optional extra); or a
            :class:`~lit_memtrain.models.generation.GenerationBackend` instance.
        generation_options: keyword arguments of the named backend's class beyond the sampling settings (e.g.
            ``{"gpu_memory_utilization": 0.4}`` for ``vllm_colocate``, ``{"base_url": ...}`` for ``vllm_server``);
            checked, with the backend's packages and its sampling support, before anything is built.
        gather_weights_for_generation: under FSDP2, gather the whole model once for generation rather than layer by
            layer per token (TRL's ``ds3_gather_for_generation``; the ``transformers`` backend).
        policy_loss: TRL's ``loss_type``: ``dapo`` (default), ``grpo``, ``dr_grpo``, ``bnpo``, ``cispo``, ``sapo``,
            ``luspo`` or ``vespo`` (:mod:`~lit_memtrain.objectives.policy_loss`). (``loss_type`` is the house's
            ``chunked`` / ``nll``.)
        importance_sampling_level, delta, sapo_temperature_pos, sapo_temperature_neg, vespo_k_pos, vespo_lambda_pos,
            vespo_k_neg, vespo_lambda_neg, off_policy_mask_threshold, top_entropy_quantile, entropy_coef,
            use_adaptive_entropy, entropy_coef_min, entropy_coef_max, entropy_coef_delta, entropy_target: TRL 1.16's
            loss variants and token controls, its names, defaults and meaning
            (:class:`~lit_memtrain.objectives.grpo_options.PolicyLossOptions`).
        multi_objective_aggregation: ``sum_then_normalize`` (default) or ``normalize_then_sum`` (each reward
            function z-scored in its group, then the weighted sum z-scored over the batch; ``scale_rewards`` unused).
        scale_rewards: ``group`` (True), ``batch`` or ``none`` (False): what advantages are divided by.
        beta: weight of the KL term to the reference (0: no reference is built or run).
        sync_ref_model, ref_model_mixup_alpha, ref_model_sync_steps: TRL's (False, 0.6, 512): every
            ``ref_model_sync_steps`` optimizer steps, ``reference = alpha * policy + (1 - alpha) * reference``
            (:mod:`~lit_memtrain.objectives.reference_sync`); the frozen-copy reference only (``beta != 0``, no
            LoRA, not under FSDP2); the mixed reference is kept in checkpoints.
        epsilon, epsilon_high: the clip range ``[1 - epsilon, 1 + epsilon_high]`` (``epsilon_high`` defaults to
            ``epsilon``).
        use_bias_correction_kl: multiply the KL term by the importance ratio (TRL's default).
        num_iterations: passes over each generation batch (TRL's ``mu``); more than one trains off-policy.
        steps_per_generation: slices each generation batch is trained in, one micro-batch each (default:
            ``gradient_accumulation_steps``).
        gradient_accumulation_steps: micro-batches per optimizer step (Lightning's ``accumulate_grad_batches`` does
            not apply to manual optimisation).
        vllm_importance_sampling_correction: TRL's (default True): with a backend that reports its sampling
            log-probabilities (the vLLM ones), weigh each token's loss by ``exp(trainer's - engine's log-probability)``
            (:mod:`~lit_memtrain.objectives.sampling_correction`); logged as TRL's ``sampling/...``. The trainer's
            log-probabilities are then computed at generation time, on-policy too. Other backends: nothing to correct.
        vllm_importance_sampling_mode, vllm_importance_sampling_clip_max, vllm_importance_sampling_clip_min: TRL's
            (``sequence_mask``, 3.0, None): per token or per sequence, truncated or masked outside the bounds.
        mask_truncated_completions: train no token of a completion that reached ``max_completion_length`` without
            an end of sequence (its reward still counts in its group).
        max_grad_norm: clip the gradients' norm to this before each optimizer step (None: no clipping); Lightning's
            ``gradient_clip_val`` does not apply to manual optimisation.
        padding_free: score each slice as one padding-free row (documents kept apart); False: right-padded rows.
        cast_lm_head_to_fp32: TRL's (default False): the LM head of the policy and of a frozen reference in fp32,
            its logits (generation, log-probabilities) computed in fp32 (:mod:`~lit_memtrain.models.lm_head_fp32`);
            not under FSDP2, with a LoRA adapter on the head, or a head tied to the embeddings.
        disable_dropout: TRL's (default False): set every dropout probability of the policy (LoRA adapter included)
            to 0 (the frozen reference scores in eval mode). Completions are always sampled without dropout (eval
            mode; vLLM has none), where TRL's ``transformers`` path samples in training mode: with dropout left on,
            the fit says so once.
        learning_rate: TRL's default, 1e-6.
        **kwargs: every argument of :class:`~lit_memtrain.objectives.causal_lm.CausalLMModule` (model, preset, lora,
            tokenizer -- required here --, dtype, loss_type, loss_chunk_size, ...).

    Logged (``train/``, TRL's names): ``reward``, ``reward_std``, ``rewards/<function>/mean`` and ``/std``,
    ``frac_reward_zero_std``, ``completions/{mean,min,max}_length``, ``completions/clipped_ratio``,
    ``completions/{mean,min,max}_terminated_length``, ``kl`` (``beta != 0``), ``clip_ratio/{low_mean,low_min,
    high_mean,high_max,region_mean}`` (the clipped losses), ``cispo_clip_ratio``, ``vespo/phi_seq_mean``,
    ``policy_loss`` and ``entropy_coef`` (with an entropy bonus), ``entropy`` (the policy's, in nats, at the sampling
    temperature, over the trained completion tokens; the chunked loss measures it in its chunks of logits, at no extra
    memory), ``loss``, ``tokens`` (trained tokens), ``aux_loss`` (a mixture-of-experts model's router load-balancing loss)
    and the throughput; ``val/reward``, ``val/rewards/<function>/mean``
    and ``val/completions/mean_length`` on validation prompts, over the whole validation set (every rank's completions,
    whatever each rank's number of prompts).

    Example:
        >>> module = GRPOModule(preset="tiny-qwen3", tokenizer="lit-memtrain/embedded", reward_funcs=[accuracy])
        >>> Trainer(max_steps=20).fit(module, datamodule=PromptDataModule(batch_size=4))  # doctest: +SKIP
    """

    def __init__(
        self,
        reward_funcs: Sequence[str | Callable[..., Any]] | str | Callable[..., Any],
        reward_weights: Sequence[float] | None = None,
        num_generations: int = 8,
        num_generations_eval: int | None = None,
        max_completion_length: int = 512,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float | None = None,
        repetition_penalty: float = 1.0,
        do_sample: bool = True,
        generation_kwargs: dict[str, Any] | None = None,
        generation_backend: str | GenerationBackend = "transformers",
        generation_options: dict[str, Any] | None = None,
        gather_weights_for_generation: bool = True,
        policy_loss: PolicyLossType = "dapo",
        importance_sampling_level: ImportanceSamplingLevel = "token",
        delta: float | None = None,
        sapo_temperature_pos: float = 1.0,
        sapo_temperature_neg: float = 1.05,
        vespo_k_pos: float = 2.0,
        vespo_lambda_pos: float = 3.0,
        vespo_k_neg: float = 3.0,
        vespo_lambda_neg: float = 2.0,
        off_policy_mask_threshold: float | None = None,
        top_entropy_quantile: float = 1.0,
        entropy_coef: float = 0.0,
        use_adaptive_entropy: bool = False,
        entropy_coef_min: float = 0.0,
        entropy_coef_max: float = 1.0,
        entropy_coef_delta: float = 0.005,
        entropy_target: float = 0.2,
        multi_objective_aggregation: str = "sum_then_normalize",
        scale_rewards: ScaleRewards | bool = "group",
        beta: float = 0.0,
        sync_ref_model: bool = False,
        ref_model_mixup_alpha: float = 0.6,
        ref_model_sync_steps: int = 512,
        epsilon: float = 0.2,
        epsilon_high: float | None = None,
        use_bias_correction_kl: bool = True,
        num_iterations: int = 1,
        steps_per_generation: int | None = None,
        gradient_accumulation_steps: int = 1,
        vllm_importance_sampling_correction: bool = True,
        vllm_importance_sampling_mode: SamplingCorrectionMode = "sequence_mask",
        vllm_importance_sampling_clip_max: float | None = 3.0,
        vllm_importance_sampling_clip_min: float | None = None,
        mask_truncated_completions: bool = False,
        max_grad_norm: float | None = 1.0,
        padding_free: bool = True,
        cast_lm_head_to_fp32: bool = False,
        disable_dropout: bool = False,
        learning_rate: float = 1e-6,
        **kwargs: Any,
    ) -> None:
        sampling = SamplingSettings(
            max_completion_length=max_completion_length, temperature=temperature, top_p=top_p, top_k=top_k,
            min_p=min_p, repetition_penalty=repetition_penalty, do_sample=do_sample,
            generation_kwargs=generation_kwargs,
        )  # fmt: skip
        # Checkpoints written while generation_batch_size was a parameter here hold it, None unless given, in their
        # hyper-parameters, which load_from_checkpoint (lit-memtrain export) passes back: None asks for nothing.
        if "generation_batch_size" in kwargs and kwargs["generation_batch_size"] is None:
            del kwargs["generation_batch_size"]
        refuse_trl_fields(type(self).__name__, kwargs)  # a TRL field not offered: its name and the reason
        check_generation_backend(generation_backend, generation_options, sampling)  # before any model or tokenizer work
        loss_options = PolicyLossOptions(
            importance_sampling_level, delta, sapo_temperature_pos, sapo_temperature_neg, vespo_k_pos,
            vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg, off_policy_mask_threshold, top_entropy_quantile,
            entropy_coef, use_adaptive_entropy, entropy_coef_min, entropy_coef_max, entropy_coef_delta, entropy_target,
        )  # fmt: skip
        check_multi_objective_aggregation(multi_objective_aggregation)
        super().__init__(learning_rate=learning_rate, **kwargs)
        self.automatic_optimization = False
        if self.tokenizer is None:
            raise ValueError(
                f"{type(self).__name__} needs a tokenizer (tokenizer=...; lit-memtrain fit links data.tokenizer): it "
                "decodes completions for the reward functions and ends them at its end-of-sequence token."
            )
        _check_positive_int("num_generations", num_generations, minimum=2)
        num_generations_eval = num_generations if num_generations_eval is None else num_generations_eval
        _check_positive_int("num_generations_eval", num_generations_eval)
        _check_positive_int("num_iterations", num_iterations)
        _check_positive_int("gradient_accumulation_steps", gradient_accumulation_steps)
        steps_per_generation = gradient_accumulation_steps if steps_per_generation is None else steps_per_generation
        _check_positive_int("steps_per_generation", steps_per_generation)
        if policy_loss not in LOSS_TYPES:
            raise ValueError(f"policy_loss (TRL's loss_type) must be one of {LOSS_TYPES}, got {policy_loss!r}.")
        check_loss_combination(policy_loss, importance_sampling_level)
        if isinstance(scale_rewards, bool):
            scale_rewards = "group" if scale_rewards else "none"
        if scale_rewards not in SCALE_REWARDS:
            raise ValueError(f"scale_rewards must be one of {SCALE_REWARDS} (or True / False), got {scale_rewards!r}.")
        epsilon_high = epsilon if epsilon_high is None else epsilon_high
        if not (0 <= epsilon < 1 and epsilon_high >= 0):
            raise ValueError(f"epsilon must be in [0, 1) and epsilon_high >= 0, got {epsilon} and {epsilon_high}.")
        if not beta >= 0:
            raise ValueError(f"beta must be >= 0 (0: no reference), got {beta}.")
        self.reference_sync = ReferenceSync(ref_model_mixup_alpha, ref_model_sync_steps) if sync_ref_model else None
        if sync_ref_model and (beta == 0 or self.lora is not None):
            raise ValueError(
                "sync_ref_model=True mixes the policy into the frozen copy of the initial model, which exists only "
                f"with beta != 0 (got {beta}) and no LoRA adapter (the reference is then the base model, as TRL "
                "refuses it with PEFT). Set sync_ref_model=False."
            )
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be > 0 or None (no clipping), got {max_grad_norm}.")
        self.sampling = sampling
        self.sampling_correction = (
            SamplingCorrection(
                vllm_importance_sampling_mode, vllm_importance_sampling_clip_max, vllm_importance_sampling_clip_min
            )
            if vllm_importance_sampling_correction
            else None
        )
        self.reward_functions = RewardFunctions(reward_funcs, reward_weights)
        self.num_generations, self.num_generations_eval = num_generations, num_generations_eval
        self.scale_rewards: ScaleRewards = scale_rewards
        self.epsilon_low, self.epsilon_high = epsilon, epsilon_high
        self.loss_options = loss_options
        self.entropy_bonus = EntropyBonus(loss_options)
        self.steps_per_generation = steps_per_generation
        self.generation_backend: GenerationBackend | None = (
            generation_backend if isinstance(generation_backend, GenerationBackend) else None
        )
        # Hyper-parameters are written to checkpoints and loggers: callables and a backend object by name.
        self.hparams["reward_funcs"] = [callable_path(function) for function in self.reward_functions.functions]
        if not isinstance(generation_backend, str):
            self.hparams["generation_backend"] = type(generation_backend).__name__
        self._backend_ready = False
        self._micro_steps = 0
        # What on_validation_epoch_end logs (val_metric_names): torchmetrics, each rank's completions summed over
        # every rank when computed, so validation needs no collective per batch (ranks may hold different numbers of
        # prompts). A function's metric is keyed by its place: its name may hold a "." (a reward model's hub id).
        self.val_metrics = nn.ModuleDict(
            {"reward": MeanMetric(nan_strategy="ignore"), "completions/mean_length": MeanMetric(),
             **{f"rewards/{i}": MeanMetric(nan_strategy="ignore") for i in range(len(self.reward_functions.names))}}
        )  # fmt: skip
        self._mean_rewards: list[float] = []
        self.completion_extras: dict[str, list[Any]] = {}  # what reward functions gave log_extra, last batch
        # The frozen reference copy (beta != 0 without LoRA) is kept out of the module tree on purpose: not in
        # state_dict (a checkpoint holds the trained model once; the reference is rebuilt from the initial weights),
        # not moved or found by callbacks (no checkpointing, no offloading: it runs without gradients).
        object.__setattr__(self, "_reference_model", None)

    # ------------------------------------------------------------------------------------------- setup

    @property
    def off_policy(self) -> bool:
        """Whether some slice is trained after an optimizer step since its generation (TRL's condition for
        computing the sampling policy's log-probabilities): ``gradient_accumulation_steps`` is not a multiple of
        ``steps_per_generation * num_iterations``."""
        return self.hparams.gradient_accumulation_steps % (self.steps_per_generation * self.hparams.num_iterations) != 0

    @property
    def needs_old_logps(self) -> bool:
        """Whether the sampling policy's log-probabilities are computed at generation time."""
        return self.off_policy

    def on_fit_start(self) -> None:
        batch_size = getattr(self.trainer.datamodule, "batch_size", None)
        if isinstance(batch_size, int):
            self._check_slices(batch_size)
        super().on_fit_start()

    def _check_slices(self, prompts: int) -> None:
        completions = prompts * self.num_generations
        if completions % self.steps_per_generation:
            raise ValueError(
                f"A batch of {prompts} prompts x num_generations={self.num_generations} = {completions} completions "
                f"cannot be split into steps_per_generation={self.steps_per_generation} equal slices. Make batch_size "
                "x num_generations a multiple of steps_per_generation (one that divides num_generations fits every "
                "batch, the last smaller one of an epoch too)."
            )

    def estimated_optimizer_steps(self) -> int:
        """The run's optimizer steps: ``steps_per_generation * num_iterations`` micro-batches per training batch
        (:meth:`~lit_memtrain.objectives.online_rl.OnlineRLModule.optimizer_steps_for`)."""
        return self.optimizer_steps_for(self.steps_per_generation * self.hparams.num_iterations)

    def generate_rollout(self, batch: dict[str, Any], where: str) -> tuple[Rollout, Tensor, dict[str, Tensor]]:
        """Generate ``num_generations`` completions of each prompt of ``batch`` and score them: the rollout, this
        rank's rewards ``[N, K]`` (one column per reward function, NaN where not scored) and the completion metrics
        TRL logs (over every rank)."""
        rollout, rewards, truncated, logged = self._generate_and_score(batch, where)
        metrics = self._completion_metrics(rollout, truncated)
        metrics.update({name: torch.tensor(statistics.fmean(values)) for name, values in logged.items()})
        return rollout, rewards, metrics

    def prepare_rollout(self, rollout: Rollout, rewards: Tensor) -> tuple[Rollout, dict[str, Tensor]]:
        """What training needs of a scored rollout: the sampling policy's log-probabilities (off-policy), the
        reference's (``beta != 0``) and this rank's share of the advantages, computed from every rank's rewards;
        and the reward metrics TRL logs; with the vLLM importance-sampling correction, its weights and metrics."""
        correction = self.sampling_correction if rollout.sampling_logps is not None else None
        old = self._no_grad_logps(rollout) if self.needs_old_logps or correction else None
        ref = self.reference_logps(rollout) if self.hparams.beta != 0 else None
        rollout = replace(rollout, old_logps=old, ref_logps=ref)
        advantages, metrics = self.compute_advantages(self._gather_rows(rewards), rollout)
        if correction is not None:
            mask, sampling = rollout.completion_mask().to(old.device), rollout.sampling_logps.to(old.device)
            ratio = correction.ratio(old, sampling, mask)
            per_rank = self._gather_rows(correction.rank_statistics(old, sampling, mask, ratio).unsqueeze(0))
            metrics.update(correction.metrics(per_rank))
            rollout = replace(rollout, sampling_ratio=ratio)
        rank = self.trainer.global_rank
        return replace(rollout, advantages=advantages[rank * len(rollout) : (rank + 1) * len(rollout)]), metrics

    def _completion_metrics(self, rollout: Rollout, truncated: Tensor) -> dict[str, Tensor]:
        lengths = self._gather_rows(torch.tensor([len(c) for c in rollout.completion_ids], dtype=torch.float32))
        clipped = self._gather_rows(truncated.float()).bool()
        terminated = lengths[~clipped] if (~clipped).any() else lengths.new_zeros(1)
        return {
            "completions/mean_length": lengths.mean(),
            "completions/min_length": lengths.min(),
            "completions/max_length": lengths.max(),
            "completions/clipped_ratio": clipped.float().mean(),
            "completions/mean_terminated_length": terminated.mean(),
            "completions/min_terminated_length": terminated.min(),
            "completions/max_terminated_length": terminated.max(),
        }

    def compute_advantages(self, rewards_per_function: Tensor, rollout: Rollout) -> tuple[Tensor, dict[str, Tensor]]:
        """GRPO's advantages of the whole generation batch (every rank's completions, ``[world * N]``) from its
        rewards ``[world * N, K]``, and the reward metrics TRL logs."""
        weights = self.reward_functions.weights.to(rewards_per_function.device)
        rewards = combine_rewards(rewards_per_function, weights)
        if self.hparams.multi_objective_aggregation == "normalize_then_sum":
            grouped = normalize_then_sum_advantages(rewards_per_function, weights, self.num_generations)
        else:
            grouped = group_relative_advantages(rewards, self.num_generations, self.scale_rewards)
        metrics = self._reward_metrics(rewards_per_function, rewards)
        metrics["frac_reward_zero_std"] = grouped.zero_std.float().mean()
        return grouped.advantages, metrics

    def _reward_metrics(self, rewards_per_function: Tensor, rewards: Tensor) -> dict[str, Tensor]:
        metrics = {"reward": torch.nanmean(rewards), "reward_std": nanstd(rewards)}
        for index, name in enumerate(self.reward_functions.names):
            metrics[f"rewards/{name}/mean"] = torch.nanmean(rewards_per_function[:, index])
            metrics[f"rewards/{name}/std"] = nanstd(rewards_per_function[:, index])
        return metrics

    # ----------------------------------------------------------------------------------------- loss

    def loss_normalizer(self, rollout: Rollout) -> Tensor | None:
        """DAPO's (CISPO's, VESPO's) divisor for the micro-batches of ``rollout`` (None for the other losses): the
        trained tokens of the generation batch over every rank, times ``gradient_accumulation_steps / (world_size *
        steps_per_generation)`` (TRL's), so that the gradients of an optimizer step, averaged over ranks, are the mean
        over every token it trains."""
        if self.hparams.policy_loss not in ("dapo", "cispo", "vespo"):
            return None
        tokens = self._sum_over_ranks(rollout.completion_mask().sum())
        scale = self.hparams.gradient_accumulation_steps / (self.trainer.world_size * self.steps_per_generation)
        return tokens.clamp(min=1.0) * scale

    def slice_loss(self, part: Rollout, normalizer: Tensor | None = None) -> PolicyLoss:
        """One micro-batch's loss: its completions scored by the policy (with gradients) in the clipped loss;
        ``normalizer``: :meth:`loss_normalizer`'s."""
        logps, entropy, router_aux = self.completion_logps_and_entropies(part)
        mask = part.completion_mask().to(logps.device)
        entropy_mask, quantile = None, self.loss_options.top_entropy_quantile
        if quantile < 1:  # the quantile of every rank's trained tokens, as TRL's
            kept = entropy.detach()[mask.bool()].float()
            every_rank = every_rank_values(kept, self.all_gather, self.trainer.world_size)
            entropy_mask = high_entropy_mask(entropy, mask, quantile, every_rank)
        out = clipped_policy_loss(
            logps, part.old_logps, part.advantages.to(logps.device), mask, loss_type=self.hparams.policy_loss,
            epsilon_low=self.epsilon_low, epsilon_high=self.epsilon_high, beta=self.hparams.beta,
            ref_logps=part.ref_logps, bias_correction_kl=self.hparams.use_bias_correction_kl,
            accumulation_steps=self.hparams.gradient_accumulation_steps,
            max_completion_length=self.sampling.max_completion_length, dapo_normalizer=normalizer,
            importance_weights=part.sampling_ratio, options=self.loss_options, entropy_mask=entropy_mask, entropies=entropy,
            entropy_coef=self.entropy_bonus.coefficient(),
            sampling_logps=None if part.sampling_logps is None else part.sampling_logps.to(logps.device),
        )  # fmt: skip
        bonus_mask = mask if entropy_mask is None else mask * entropy_mask
        self.entropy_bonus.observe((entropy.detach() * bonus_mask).sum(), bonus_mask.sum())
        return self.with_router_aux(replace(out, entropy=entropy.detach()), router_aux)

    def _record(self, stats: _StepStats, out: PolicyLoss, part: Rollout) -> None:
        """Add a micro-batch's loss and clip flags to ``stats``: per token, or per completion where the ratio is
        one per completion (RLOO)."""
        if out.ratio.dim() == 1:
            mask = torch.ones(len(part), 1, device=out.ratio.device)
            low, high = out.low_clipped.unsqueeze(1), out.high_clipped.unsqueeze(1)
        else:
            mask, low, high = part.completion_mask().to(out.ratio.device), out.low_clipped, out.high_clipped
        per_completion = mask.sum(-1)
        stats.losses.append(out.loss.detach())
        stats.counted.append(mask.sum())
        if low is not None:  # the clipped losses' flags (TRL logs no clip_ratio for cispo, sapo, vespo)
            stats.low.append((low * mask).sum())
            stats.high.append((high * mask).sum())
            stats.low_per_completion.append((low * mask).sum(-1) / per_completion)
            stats.high_per_completion.append((high * mask).sum(-1) / per_completion)
        if out.policy_loss is not None:
            stats.policy_losses.append(out.policy_loss)
        for name, value in out.means.items():  # per token, or per completion for [B] values
            weights = part.completion_mask().to(value.device) if value.dim() == 2 else torch.ones_like(value)
            stats.means.setdefault(name, []).append(torch.stack([(value * weights).sum(), weights.sum()]))
        if out.kl is not None:
            stats.kl.append((out.kl * mask).sum())
        if out.router_aux is not None:
            stats.router_aux.append(out.router_aux)
        if out.entropy is not None:  # over the trained tokens, whatever the flags count over
            stats.entropy.append(out.entropy.sum())
            stats.entropy_tokens.append(part.completion_mask().sum().to(out.entropy.device))

    def _loss_metrics(self, stats: _StepStats) -> dict[str, Tensor]:
        passes = len(stats.losses)  # the micro-batches trained: fewer than the batch's when max_steps stopped it
        world = self.trainer.world_size
        loss = self._sum_over_ranks(torch.stack(stats.losses).sum()) * self.hparams.gradient_accumulation_steps
        counted = self._sum_over_ranks(torch.stack(stats.counted).sum()).clamp(min=1)
        metrics = {"loss": loss / (passes * world)}
        if stats.low:
            low = self._sum_over_ranks(torch.stack(stats.low).sum()) / counted
            high = self._sum_over_ranks(torch.stack(stats.high).sum()) / counted
            metrics |= {
                "clip_ratio/low_mean": low,
                "clip_ratio/high_mean": high,
                "clip_ratio/region_mean": low + high,
                "clip_ratio/low_min": _nanmin(self._gather_rows(torch.cat(stats.low_per_completion))),
                "clip_ratio/high_max": _nanmax(self._gather_rows(torch.cat(stats.high_per_completion))),
            }
        if stats.policy_losses:
            policy = self._sum_over_ranks(torch.stack(stats.policy_losses).sum())
            metrics["policy_loss"] = policy * self.hparams.gradient_accumulation_steps / (passes * world)
        for name, sums in stats.means.items():
            total = self._sum_over_ranks(torch.stack(sums).sum(0))
            metrics[name] = total[0] / total[1].clamp(min=1)
        if self.entropy_bonus.enabled:
            metrics["entropy_coef"] = torch.tensor(self.entropy_bonus.coef, device=self.device)
        if stats.router_aux:  # TRL's: the mean of the micro-batches' load-balancing losses over every rank
            metrics["aux_loss"] = self._sum_over_ranks(torch.stack(stats.router_aux).mean()) / world
        if stats.kl:
            metrics["kl"] = self._sum_over_ranks(torch.stack(stats.kl).sum()) / counted
        if stats.entropy:
            tokens = self._sum_over_ranks(torch.stack(stats.entropy_tokens).sum()).clamp(min=1)
            metrics["entropy"] = self._sum_over_ranks(torch.stack(stats.entropy).sum()) / tokens
        return metrics

    # ----------------------------------------------------------------------------------------- steps

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        """Generate and score one generation batch, then train on it (see the module docstring)."""
        where = f"training batch {batch_idx} (epoch {self.current_epoch}, global step {self.trainer.global_step})"
        self._check_slices(len(batch["prompt_ids"]))  # before any work
        rollout, rewards, metrics = self.generate_rollout(batch, where)
        rollout, reward_metrics = self.prepare_rollout(rollout, rewards)
        metrics.update(reward_metrics)
        order = torch.randperm(len(rollout)) if self.steps_per_generation > 1 else None  # TRL shuffles once
        slices = rollout.split(self.steps_per_generation, order)
        normalizer = self.loss_normalizer(rollout)
        optimizer, stats = self.optimizers(), _StepStats()
        for part in [part for _ in range(self.hparams.num_iterations) for part in slices]:
            out = self.slice_loss(part, normalizer)
            self.manual_backward(out.loss)
            self._record(stats, out, part)
            self._micro_steps += 1
            if self._micro_steps % self.hparams.gradient_accumulation_steps == 0:
                self._optimizer_step(optimizer)
                if 0 < self.trainer.max_steps <= self.trainer.global_step:
                    break  # as the Hugging Face Trainer stops: the batch's other slices are not trained
        self._close_window_at_epoch_end(optimizer, batch_idx)
        metrics.update(self._loss_metrics(stats))
        prompts = len(batch["prompt_ids"])
        for name, value in metrics.items():
            self.log(f"train/{name}", value.float(), prog_bar=name in ("reward", "loss"), batch_size=prompts)
        self.log("train/tokens", self.throughput.tokens_seen_metric(), batch_size=prompts)
        if self._first_loss is None:
            self._first_loss = metrics["loss"]
        self._last_loss = metrics["loss"]
        self._mean_rewards.append(float(metrics["reward"]))
        return metrics["loss"]

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        """Generate and score completions of validation prompts (no loss): this rank's completions update
        :attr:`val_metrics` (NaN, unscored, rewards left out, as ``nanmean`` does), but those of a prompt repeated
        to even out the ranks (:func:`~lit_memtrain.datamodules.batch.scored_rows`), which weigh 0."""
        where = f"validation batch {batch_idx} (global step {self.trainer.global_step})"
        rollout, rewards, _, _ = self._generate_and_score(batch, where)
        rewards = rewards.to(self.device)
        prompts = scored_rows(batch, len(batch["prompt_ids"]), self.device)
        weights = prompts.repeat_interleave(self.num_generations_eval).float()  # completions of a prompt follow it
        metrics = self.val_metrics
        metrics["reward"].update(combine_rewards(rewards, self.reward_functions.weights), weight=weights)
        lengths = torch.tensor([len(ids) for ids in rollout.completion_ids], dtype=torch.float32, device=self.device)
        metrics["completions/mean_length"].update(lengths, weight=weights)
        for index in range(rewards.shape[1]):
            metrics[f"rewards/{index}"].update(rewards[:, index], weight=weights)

    def val_metric_names(self) -> dict[str, str]:
        """What each of :attr:`val_metrics` is logged as, after ``val/``: TRL's names."""
        names = {"reward": "reward", "completions/mean_length": "completions/mean_length"}
        return names | {f"rewards/{i}": f"rewards/{name}/mean" for i, name in enumerate(self.reward_functions.names)}

    def on_validation_epoch_end(self) -> None:
        # The metric objects are logged, on every rank: Lightning computes each once, over every rank's updates.
        names = self.val_metric_names()
        for key, metric in self.val_metrics.items():
            self.log(f"val/{names[key]}", metric, prog_bar=key == "reward")

    def on_train_end(self) -> None:
        super().on_train_end()
        rewards = self._mean_rewards
        if rewards:
            window = max(1, min(10, len(rewards) // 2))
            self.print(
                f"mean reward: first {window} batches {statistics.fmean(rewards[:window]):.4f} -> last {window} "
                f"batches {statistics.fmean(rewards[-window:]):.4f} over {len(rewards)} batches"
            )

    @property
    def trains_on_entropy(self) -> bool:
        """With an entropy bonus, the loss trains on the policy's entropy: scored with its gradient."""
        return self.entropy_bonus.enabled

    def _optimizer_step(self, optimizer: Any) -> None:
        super()._optimizer_step(optimizer)
        self.entropy_bonus.end_step(self._sum_over_ranks)  # the adaptive coefficient, from the step's entropy

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint["lit_memtrain"]["entropy_bonus"] = self.entropy_bonus.state_dict()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        if "entropy_bonus" in checkpoint.get("lit_memtrain", {}):
            self.entropy_bonus.load_state_dict(checkpoint["lit_memtrain"]["entropy_bonus"])


def _nanmin(values: Tensor) -> Tensor:
    kept = values[~torch.isnan(values)]
    return kept.min() if kept.numel() else values.new_tensor(float("nan"))


def _nanmax(values: Tensor) -> Tensor:
    kept = values[~torch.isnan(values)]
    return kept.max() if kept.numel() else values.new_tensor(float("nan"))
