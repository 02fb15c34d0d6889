"""OnlineDPOModule: Online DPO (TRL's ``OnlineDPOTrainer``), DPO's loss on pairs the policy samples and a judge ranks.

Why an online-RL module rather than a DPO option: the pairs are not data but the policy's own completions, drawn
each step with a generation backend and ranked by a judge, so the step is the online methods' (generation, scoring,
a reference, manual optimisation: :class:`~lit_memtrain.objectives.online_rl.OnlineRLModule`), and only its loss is
DPO's (:func:`~lit_memtrain.objectives.preference_loss.preference_loss`).

One training step (one batch of ``P`` prompts on each rank), as TRL 1.16's ``OnlineDPOTrainer.training_step``:

1. **Generate** two completions per prompt with the generation backend (at most ``max_new_tokens`` each).
2. **Judge** each pair: the weighted sum of the reward functions' scores (a trained reward model is one:
   :class:`~lit_memtrain.objectives.reward_model_function.RewardModelFunction`), less ``missing_eos_penalty`` for a
   completion with no end of sequence; the higher scored completion is chosen (the first on a tie). Or a pairwise
   judge (TRL's ``BasePairwiseJudge`` shape: ``judge(prompts, completion_pairs) -> [0 or 1 per pair]``, the index
   of the better completion) picks it.
3. **Score** both completions under the policy (with gradients) and the reference (without): the model with its
   LoRA adapter disabled, else a frozen copy of the initial model. Log-probabilities are at temperature 1 (TRL's
   Online DPO scores the raw logits, whatever the sampling ``temperature``), from the final hidden states in
   chunks, the completions of the batch in one padding-free row; a prompt is cut from the left so that prompt +
   the longest completion of the rank's batch fit ``max_length``, as TRL does.
4. **Train** on ``mean(loss(beta * (logratio_chosen - logratio_rejected)))``: ``sigmoid`` (DPO) or ``ipo``
   (``(logratio margin - 1 / (2 beta))^2``, on the summed log-ratios: TRL's Online DPO does not divide them by the
   completions' lengths, its offline DPO does), divided by ``gradient_accumulation_steps``; an optimizer step every
   ``gradient_accumulation_steps`` batches, and after an epoch's last batch on a window left open (rescaled to the
   mean over its batches), as the Hugging Face Trainer steps at an epoch's end.

TRL's ``OnlineDPOConfig`` has ``generation_kwargs`` and ``disable_dropout`` (default True), taken here under those
names; it has none of GRPO's ``cast_lm_head_to_fp32``, ``sync_ref_model``, ``num_generations_eval``,
``generation_batch_size`` (which GRPOModule refuses too, with its translation) or vLLM importance-sampling
correction, which are refused with that reason, nor adds a
mixture-of-experts router's load-balancing loss: a model with routers is refused at fit start unless
``router_aux_loss_coef=0``. TRL's trainer keeps an epoch's last, smaller batch: ``PromptDataModule(drop_last=False)``
does the same (its default, True, is TRL's GRPO sampler's).
"""

from __future__ import annotations

import numbers
import statistics
import warnings
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor, nn
from torchmetrics import MeanMetric

from lit_memtrain.datamodules.batch import scored_rows
from lit_memtrain.models.generation import GenerationBackend, SamplingSettings
from lit_memtrain.objectives.online_rl import OnlineRLModule, callable_path, check_generation_backend
from lit_memtrain.objectives.preference_loss import LOSS_TYPES, PreferenceLossType, preference_loss
from lit_memtrain.objectives.reward_functions import RewardFunctions, resolve_reward_function
from lit_memtrain.objectives.rollout import Rollout

__all__ = ["OnlineDPOModule"]

# GRPOModule's TRL options that TRL 1.16's OnlineDPOConfig does not have (their OnlineRLModule machinery reads them).
_GRPO_ONLY = ("cast_lm_head_to_fp32", "sync_ref_model", "ref_model_mixup_alpha", "ref_model_sync_steps",
              "num_generations_eval", "generation_batch_size", "vllm_importance_sampling_correction",
              "vllm_importance_sampling_mode", "vllm_importance_sampling_clip_max",
              "vllm_importance_sampling_clip_min")  # fmt: skip


class OnlineDPOModule(OnlineRLModule):
    """Train a causal LM with Online DPO on prompts: pairs of its own completions, ranked by a judge.

    Args:
        reward_funcs: reward functions with TRL's signature ``f(prompts, completions, completion_ids, **columns)
            -> list[float | None]`` (a :class:`~lit_memtrain.objectives.reward_model_function.RewardModelFunction` is
            one), or import paths to them; the score is their weighted sum (``None``, unscored, counts 0, as TRL).
        judge: instead of ``reward_funcs``, a pairwise judge: an object with TRL's ``BasePairwiseJudge.judge(prompts,
            completions)`` method, or a callable of the same arguments (or an import path to either), given the
            ``P`` prompts and ``P`` pairs ``[first, second]`` of completions, returning the index (0 or 1) of the
            better completion of each pair.
        reward_weights: one weight per reward function (default 1.0 each).
        beta: the pull towards the reference (IPO's tau); a list gives one value per epoch, the last for the epochs
            after (TRL's). TRL's default 0.1.
        preference_loss: TRL's ``loss_type``: ``sigmoid`` (default) or ``ipo``. (``loss_type`` is the house's
            ``chunked`` / ``nll``: how log-probabilities are computed.)
        missing_eos_penalty: subtracted from the score of a completion that reached ``max_new_tokens`` without an end
            of sequence (None: none). Scores only: refused with a ``judge``.
        max_new_tokens: tokens per completion at most (TRL's default 64).
        max_length: prompt + completion tokens scored at most: longer prompts lose their first tokens (TRL's default
            512); must exceed ``max_new_tokens``.
        temperature, top_p, top_k, min_p, repetition_penalty, generation_kwargs: how completions are drawn (TRL's
            names and defaults: temperature 0.9; ``generation_kwargs``: further arguments of the backend's sampling);
            ``do_sample`` (ours): False decodes greedily.
        generation_backend, generation_options, gather_weights_for_generation: as for
            :class:`~lit_memtrain.objectives.grpo.GRPOModule` (``gather_weights_for_generation`` is TRL's
            ``ds3_gather_for_generation``; the vLLM backends are TRL's ``use_vllm`` with ``vllm_mode``).
        gradient_accumulation_steps: batches per optimizer step, each batch's loss divided by it (TRL 1.16's
            ``OnlineDPOTrainer`` sums the window's gradients instead, under transformers 5: docs/online_rl.md).
        max_grad_norm: clip the gradients' norm to this before each optimizer step (None: no clipping; TRL's 1.0).
        padding_free: score a batch's completions as one padding-free row; False: right-padded rows.
        disable_dropout: TRL's (default True, as its ``OnlineDPOConfig``): every dropout probability of the policy
            (LoRA adapter included) set to 0.
        learning_rate: TRL's default, 5e-7.
        **kwargs: every argument of :class:`~lit_memtrain.objectives.causal_lm.CausalLMModule` (model, preset, lora,
            tokenizer -- required here --, dtype, loss_type, loss_chunk_size, ...).

    Logged (``train/`` then TRL's names, over every rank's completions): ``loss``, ``objective/kl`` (the summed
    log-ratio to the reference, per completion), ``objective/entropy`` (minus the summed log-probability),
    ``objective/non_score_reward`` (``-beta * kl``), ``rewards/{chosen,rejected,accuracies,margins}``,
    ``logps/{chosen,rejected}``, ``val/contain_eos_token``, ``beta``; with reward functions ``objective/scores``,
    ``objective/scores_margin`` and ``objective/rlhf_reward``. Sums are over each completion's tokens (TRL's
    ``objective/kl`` and ``objective/entropy`` also add the positions past a completion's end in its padded batch).
    On validation prompts: ``val/objective/scores`` (reward functions) and ``val/contain_eos_token``.

    Example:
        >>> module = OnlineDPOModule(preset="tiny-qwen3", tokenizer="lit-memtrain/embedded", reward_funcs=[accuracy])
        >>> Trainer(max_steps=20).fit(module, datamodule=PromptDataModule(batch_size=4))  # doctest: +SKIP
    """

    def __init__(
        self,
        reward_funcs: Sequence[str | Callable[..., Any]] | str | Callable[..., Any] | None = None,
        judge: str | Any | None = None,
        reward_weights: Sequence[float] | None = None,
        beta: float | Sequence[float] = 0.1,
        preference_loss: PreferenceLossType = "sigmoid",
        missing_eos_penalty: float | None = None,
        max_new_tokens: int = 64,
        max_length: int = 512,
        temperature: float = 0.9,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float | None = None,
        repetition_penalty: float = 1.0,
        do_sample: bool = True,
        generation_kwargs: dict[str, Any] | None = None,
        generation_backend: str | GenerationBackend = "transformers",
        generation_options: dict[str, Any] | None = None,
        gather_weights_for_generation: bool = True,
        gradient_accumulation_steps: int = 1,
        max_grad_norm: float | None = 1.0,
        padding_free: bool = True,
        disable_dropout: bool = True,
        learning_rate: float = 5e-7,
        **kwargs: Any,
    ) -> None:
        given = [name for name in _GRPO_ONLY if name in kwargs]
        if given:
            raise ValueError(
                f"{given} are GRPO options (TRL's GRPOConfig has them, its OnlineDPOConfig does not); OnlineDPOModule "
                "does not take them. Leave them out, or train with GRPOModule."
            )
        if (reward_funcs is None) == (judge is None):
            raise ValueError(
                "Give OnlineDPOModule either reward_funcs (scores, a reward model among them) or a pairwise judge, "
                f"not {'both' if judge is not None else 'neither'}: the judge ranks each pair of completions."
            )
        if judge is not None and missing_eos_penalty is not None:
            raise ValueError(
                "missing_eos_penalty lowers scores, and a pairwise judge gives none; use reward_funcs to penalise "
                "completions without an end of sequence."
            )
        if missing_eos_penalty is not None and not missing_eos_penalty >= 0:
            raise ValueError(f"missing_eos_penalty must be >= 0 (TRL: a positive value) or None: {missing_eos_penalty}")
        betas = [beta] if isinstance(beta, numbers.Real) else list(beta)
        if not betas or not all(isinstance(b, numbers.Real) and b > 0 for b in betas):
            raise ValueError(f"beta must be > 0, or a non-empty list of such values (one per epoch), got {beta!r}.")
        if preference_loss not in LOSS_TYPES:
            raise ValueError(f"preference_loss (TRL's loss_type) must be one of {LOSS_TYPES}, got {preference_loss!r}.")
        sampling = SamplingSettings(
            max_completion_length=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
            repetition_penalty=repetition_penalty, do_sample=do_sample, generation_kwargs=generation_kwargs,
        )  # fmt: skip
        if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length <= max_new_tokens:
            raise ValueError(
                f"max_length (prompt + completion tokens scored) must be an int above max_new_tokens={max_new_tokens}, "
                f"so that every completion keeps some prompt; got {max_length!r}."
            )
        if isinstance(gradient_accumulation_steps, bool) or not isinstance(gradient_accumulation_steps, int) or (
            gradient_accumulation_steps < 1
        ):
            raise ValueError(f"gradient_accumulation_steps must be an int >= 1, got {gradient_accumulation_steps!r}.")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be > 0 or None (no clipping), got {max_grad_norm}.")
        check_generation_backend(generation_backend, generation_options, sampling)  # before any model work
        super().__init__(learning_rate=learning_rate, **kwargs)
        self.automatic_optimization = False
        if self.tokenizer is None:
            raise ValueError(
                "OnlineDPOModule needs a tokenizer (tokenizer=...; lit-memtrain fit links data.tokenizer): completions "
                "are decoded for the judge and end at its end-of-sequence token."
            )
        self.sampling = sampling
        self.betas = [float(b) for b in betas]
        self.num_generations = self.num_generations_eval = 2  # a pair per prompt, adjacent (validation too)
        self.reference_sync = None  # TRL's OnlineDPOConfig has no sync_ref_model
        self.completion_extras: dict[str, list[Any]] = {}  # what reward functions gave log_extra, last batch
        self.steps_per_generation = 1  # the reference scores a batch's completions in one pass, as the policy does
        self.reward_functions = RewardFunctions(reward_funcs, reward_weights) if reward_funcs is not None else None
        self.judge = _pairwise_judge(judge) if judge is not None else None
        self.generation_backend: GenerationBackend | None = (
            generation_backend if isinstance(generation_backend, GenerationBackend) else None
        )
        # Hyper-parameters are written to checkpoints and loggers: callables and a backend object by name.
        if self.reward_functions is not None:
            self.hparams["reward_funcs"] = [callable_path(function) for function in self.reward_functions.functions]
        if judge is not None and not isinstance(judge, str):  # a judge object is named, and must be passed again
            described = f"<a {type(judge).__name__} object: pass it again as judge>"
            self.hparams["judge"] = callable_path(judge) if hasattr(judge, "__qualname__") else described
        if not isinstance(generation_backend, str):
            self.hparams["generation_backend"] = type(generation_backend).__name__
        self._backend_ready = False
        self._micro_steps = 0
        self.val_metrics = nn.ModuleDict({"contain_eos_token": MeanMetric()})
        if self.reward_functions is not None:
            self.val_metrics["objective/scores"] = MeanMetric()
        self._chosen_scores: list[float] = []
        # The frozen reference copy (no LoRA) is kept out of the module tree, as GRPOModule's.
        object.__setattr__(self, "_reference_model", None)

    @property
    def beta(self) -> float:
        """This epoch's beta (the last of the list for later epochs, as TRL)."""
        epoch = self.current_epoch if self._trainer is not None else 0
        return self.betas[min(epoch, len(self.betas) - 1)]

    @property
    def scoring_temperature(self) -> float:
        """1: TRL's Online DPO scores completions on the raw logits, whatever the sampling temperature."""
        return 1.0

    def estimated_optimizer_steps(self) -> int:
        """The run's optimizer steps: one micro-batch per training batch
        (:meth:`~lit_memtrain.objectives.online_rl.OnlineRLModule.optimizer_steps_for`)."""
        return self.optimizer_steps_for(1)

    def on_fit_start(self) -> None:
        if self.router_aux_weight():
            raise ValueError(
                f"{type(self.model).__name__} has routers: OnlineDPOModule does not add the router load-balancing loss "
                "(TRL's OnlineDPOTrainer does not either). Set router_aux_loss_coef=0 to train it without that loss."
            )
        super().on_fit_start()

    # ----------------------------------------------------------------------------------- judging

    def score_completions(
        self, prompts: list[Any], completions: list[Any], completion_ids: list[list[int]],
        columns: dict[str, list[Any]], where: str, **extra: Any,
    ) -> Tensor:  # fmt: skip
        """``[N, K]`` reward functions' scores, or with a judge ``[N, 1]``: 1 for the completion it prefers in each
        pair, 0 for the other."""
        if self.judge is None:
            return super().score_completions(prompts, completions, completion_ids, columns, where, **extra)
        judge, name = self.judge
        pairs = [[completions[i], completions[i + 1]] for i in range(0, len(completions), 2)]
        try:
            ranks = judge(list(prompts[::2]), pairs)
        except Exception as error:  # noqa: BLE001 - re-raised with the judge and the batch named
            raise RuntimeError(f"The judge {name!r} raised {type(error).__name__} on {where}: {error}") from error
        if hasattr(ranks, "tolist"):
            ranks = ranks.tolist()
        if isinstance(ranks, (str, bytes)) or not hasattr(ranks, "__len__") or len(ranks) != len(pairs):
            found = f"{len(ranks)} values" if hasattr(ranks, "__len__") else f"a {type(ranks).__name__}"
            raise ValueError(
                f"The judge {name!r} returned {found} on {where}, but {len(pairs)} were expected: one index (0 or 1) "
                "of the better completion per pair."
            )
        wrong = [(i, rank) for i, rank in enumerate(ranks) if isinstance(rank, bool) or rank not in (0, 1)]
        if wrong:
            raise ValueError(
                f"The judge {name!r} returned {wrong[0][1]!r} for pair {wrong[0][0]} of {where} ({len(wrong)} such "
                "values); it must return 0 or 1, the index of the better completion of each pair."
            )
        scores = torch.zeros(len(completions), 1)
        scores[torch.arange(len(pairs)) * 2 + torch.tensor(ranks, dtype=torch.long), 0] = 1.0
        return scores

    def pair_scores(self, scores: Tensor, truncated: Tensor, where: str) -> Tensor:
        """``[N]``: the completions' scores (weighted sum, unscored as 0; the judge's 1 / 0), less
        ``missing_eos_penalty`` for the truncated ones; warns when no completion of the batch ended."""
        penalty = self.hparams.missing_eos_penalty
        if bool(truncated.all()):
            warnings.warn(
                f"None of the {truncated.numel()} completions of {where} ended within max_new_tokens="
                f"{self.sampling.max_completion_length} (no end-of-sequence token): "
                + (f"missing_eos_penalty={penalty} lowered all {truncated.numel()} scores."
                   if penalty is not None else "no missing_eos_penalty is set, so the judge compares cut-off text.")
                + " Raise max_new_tokens, or check that the prompts ask for a short answer.",
                stacklevel=2,
            )  # fmt: skip
        if self.reward_functions is None:
            return scores[:, 0]
        weights = self.reward_functions.weights.to(scores.device)
        combined = (scores * weights.unsqueeze(0)).nansum(dim=1)
        if penalty is not None:
            combined = combined - penalty * truncated.to(combined.device).float()
        return combined

    def fit_max_length(self, rollout: Rollout) -> Rollout:
        """``rollout`` with each prompt cut from the left so that it and the longest completion fit ``max_length``."""
        keep = self.hparams.max_length - rollout.width
        if all(len(p) <= keep for p in rollout.prompt_ids):
            return rollout
        return replace(rollout, prompt_ids=[p[-keep:] for p in rollout.prompt_ids])

    # ----------------------------------------------------------------------------------------- steps

    def pair_step(self, rollout: Rollout, scores: Tensor, truncated: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """The loss of a rank's pairs (``rollout``: two adjacent completions per prompt; ``scores`` ``[N]``,
        penalised) and the metrics TRL logs, over every rank."""
        rollout = self.fit_max_length(rollout)
        logps = self.completion_logps(rollout)
        ref = self.reference_logps(rollout)
        mask = rollout.completion_mask().to(logps.device)
        sums, ref_sums = (logps * mask).sum(-1), (ref.to(logps) * mask).sum(-1)
        scores = scores.to(logps.device)
        first_chosen = scores[0::2] >= scores[1::2]
        pairs = torch.arange(len(rollout) // 2, device=logps.device) * 2
        chosen, rejected = pairs + (~first_chosen).long(), pairs + first_chosen.long()
        ones = torch.ones(len(pairs), device=logps.device)  # TRL's Online DPO IPO: summed log-ratios, not per token
        beta = self.beta
        out = preference_loss(
            sums[chosen], sums[rejected], ref_sums[chosen], ref_sums[rejected], beta, self.hparams.preference_loss,
            ones, ones,
        )  # fmt: skip
        loss = out.losses.mean()
        kl = (sums - ref_sums).detach()
        per_completion = [kl, -sums.detach(), -beta * kl, (~truncated).float().to(kl.device)]
        per_pair = [out.chosen_rewards, out.rejected_rewards, sums[chosen].detach(), sums[rejected].detach()]
        if self.reward_functions is not None:
            per_completion += [scores, scores + (-beta * kl)]
            per_pair += [scores[chosen], scores[chosen] - scores[rejected]]
        completions = self._gather_rows(torch.stack(per_completion, dim=1)).mean(0)
        gathered = self._gather_rows(torch.stack(per_pair, dim=1))
        chosen_rewards, rejected_rewards = gathered[:, 0], gathered[:, 1]
        metrics = {
            "loss": self._sum_over_ranks(loss.detach()) / self.trainer.world_size,
            "objective/kl": completions[0],
            "objective/entropy": completions[1],
            "objective/non_score_reward": completions[2],
            "val/contain_eos_token": completions[3],
            "rewards/chosen": chosen_rewards.mean(),
            "rewards/rejected": rejected_rewards.mean(),
            "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean(),
            "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
            "logps/chosen": gathered[:, 2].mean(),
            "logps/rejected": gathered[:, 3].mean(),
            "beta": torch.tensor(beta),
        }
        if self.reward_functions is not None:
            metrics.update({
                "objective/scores": completions[4], "objective/rlhf_reward": completions[5],
                "objective/scores_margin": gathered[:, 5].mean(), "chosen_scores": gathered[:, 4].mean(),
            })  # fmt: skip
        return loss, metrics

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        """Generate, judge and train on one batch of prompts (see the module docstring)."""
        where = f"training batch {batch_idx} (epoch {self.current_epoch}, global step {self.trainer.global_step})"
        rollout, scores, truncated, _ = self._generate_and_score(batch, where)
        loss, metrics = self.pair_step(rollout, self.pair_scores(scores, truncated, where), truncated)
        self.manual_backward(loss / self.hparams.gradient_accumulation_steps)
        self._micro_steps += 1
        if self._micro_steps % self.hparams.gradient_accumulation_steps == 0:
            self._optimizer_step(self.optimizers())
        self._close_window_at_epoch_end(self.optimizers(), batch_idx)
        prompts = len(batch["prompt_ids"])
        chosen_scores = metrics.pop("chosen_scores", None)
        if chosen_scores is not None:
            self._chosen_scores.append(float(chosen_scores))
        for name, value in metrics.items():
            self.log(f"train/{name}", value.float(), prog_bar=name in ("loss", "rewards/margins"), batch_size=prompts)
        self.log("train/tokens", self.throughput.tokens_seen_metric(), batch_size=prompts)
        if self._first_loss is None:
            self._first_loss = metrics["loss"]
        self._last_loss = metrics["loss"]
        return metrics["loss"]

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        """Generate and score completions of validation prompts (no loss); a prompt repeated to even out the ranks
        (:func:`~lit_memtrain.datamodules.batch.scored_rows`) weighs 0."""
        where = f"validation batch {batch_idx} (global step {self.trainer.global_step})"
        _, scores, truncated, _ = self._generate_and_score(batch, where)
        weights = scored_rows(batch, len(batch["prompt_ids"]), self.device).repeat_interleave(2).float()
        self.val_metrics["contain_eos_token"].update((~truncated).float().to(self.device), weight=weights)
        if self.reward_functions is not None:
            penalised = self.pair_scores(scores, truncated, where).to(self.device)
            self.val_metrics["objective/scores"].update(penalised, weight=weights)

    def on_validation_epoch_end(self) -> None:
        for key, metric in self.val_metrics.items():
            self.log(f"val/{key}", metric, prog_bar=key == "objective/scores")

    def on_train_end(self) -> None:
        super().on_train_end()
        scores = self._chosen_scores
        if scores:
            window = max(1, min(10, len(scores) // 2))
            self.print(
                f"mean score of the chosen completions: first {window} batches {statistics.fmean(scores[:window]):.4f}"
                f" -> last {window} batches {statistics.fmean(scores[-window:]):.4f} over {len(scores)} batches"
            )


def _pairwise_judge(spec: str | Any) -> tuple[Callable[[list[Any], list[list[Any]]], Any], str]:
    """The judge as a callable of ``(prompts, completion_pairs)`` and its name: an object's ``judge`` method (TRL's
    ``BasePairwiseJudge``), or a callable, either given or named by an import path."""
    judge = resolve_reward_function(spec) if isinstance(spec, str) else spec
    if isinstance(judge, type):
        judge = judge()
    method = getattr(judge, "judge", None)
    function = method if callable(method) else judge
    if not callable(function):
        raise ValueError(
            f"judge must be a pairwise judge (an object with a judge(prompts, completions) method, as TRL's "
            f"BasePairwiseJudge) or a callable of (prompts, completion_pairs), got a {type(judge).__name__}."
        )
    name = getattr(judge, "__name__", None) or type(judge).__name__
    return function, name
