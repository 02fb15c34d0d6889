"""Every field of TRL 1.16's ``GRPOConfig`` and ``RLOOConfig``, and what GRPOModule / RLOOModule make of it.

Why a table in code: a TRL user brings a working config over. Each field is either taken under the same name and
meaning (``same``), found under another name or in another place (``renamed``: the module, the datamodule, the
Lightning Trainer or a callback), or ``not offered``, with the reason. The modules refuse a field they do not take
with that sentence (:func:`refuse_trl_fields`) rather than a bare ``TypeError``; docs/online_rl.md shows the table
beside TRL's defaults, and a test checks that this table names every field of the installed TRL (an upgrade that
adds one fails it).

Example:
    >>> refuse_trl_fields("GRPOModule", {"use_liger_kernel": True})  # doctest: +SKIP
    ValueError: GRPOModule does not offer TRL's use_liger_kernel (a TrainingArguments field of GRPOConfig and
    RLOOConfig): the chunked log-probabilities (loss_type='chunked', the default) already keep ...
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from lit_memtrain.objectives.causal_lm import CausalLMModule

__all__ = ["TRL_FIELDS", "TrlField", "refuse_trl_fields"]

Status = Literal["same", "renamed", "not offered"]


@dataclass(frozen=True)
class TrlField:
    """One TRL field: ``status``, ``ours`` (where it went, for ``renamed``) and ``why`` (the reason, or a note)."""

    status: Status
    ours: str = ""
    why: str = ""
    configs: Literal["both", "GRPOConfig", "RLOOConfig"] = "both"


def _same(why: str = "", configs: Literal["both", "GRPOConfig", "RLOOConfig"] = "both") -> TrlField:
    return TrlField("same", "", why, configs)


def _grpo(why: str = "") -> TrlField:
    return TrlField("same", "", why, "GRPOConfig")


def _renamed(ours: str, why: str = "", configs: Literal["both", "GRPOConfig", "RLOOConfig"] = "both") -> TrlField:
    return TrlField("renamed", ours, why, configs)


def _no(why: str, configs: Literal["both", "GRPOConfig", "RLOOConfig"] = "both") -> TrlField:
    return TrlField("not offered", "", why, configs)


_TRAINER = "the Lightning Trainer's"
_NO_HUB = "nothing is uploaded during a run: export (lit-memtrain export) and upload the folder"
_LOGGER = "a Lightning logger: Trainer(logger=...)"
_CHECKPOINT = "Lightning's ModelCheckpoint callback"
_EVAL = "validation runs the reward functions on held-out prompts and logs val/ metrics over every rank"
_LOADER = "PromptDataModule's dataloaders keep Lightning's defaults"
_DDP = "Lightning's own strategy options (GRPO/RLOO are tested on one device and FSDP2Strategy)"

TRL_FIELDS: dict[str, TrlField] = {
    # --- transformers.TrainingArguments, inherited by both configs
    "output_dir": _renamed("Trainer(default_root_dir=...)", _TRAINER),
    "per_device_train_batch_size": _renamed(
        "PromptDataModule(batch_size=...)", "counts prompts (each rank draws num_generations completions of each): "
        "TRL's counts completions"
    ),
    "num_train_epochs": _renamed("Trainer(max_epochs=...)", _TRAINER),
    "max_steps": _renamed("Trainer(max_steps=...)", "counts optimizer steps, as TRL's"),
    "learning_rate": _same(),
    "lr_scheduler_type": _renamed("lr_scheduler={...} (a torch scheduler spec)", "default: warmup then cosine decay to "
                                  "min_lr_ratio (TRL: linear)"),
    "lr_scheduler_kwargs": _renamed("lr_scheduler={...}", "the scheduler's arguments in its spec"),
    "warmup_steps": _renamed("warmup", "steps (int) or a fraction of the run (float < 1); default 0.03 (TRL: 0)"),
    "optim": _renamed("optimizer={...} (a torch optimizer spec)", "default AdamW"),
    "optim_args": _renamed("optimizer={...}", "the optimizer's arguments in its spec"),
    "weight_decay": _same(),
    "adam_beta1": _renamed("betas=(beta1, beta2)"),
    "adam_beta2": _renamed("betas=(beta1, beta2)"),
    "adam_epsilon": _renamed("optimizer={...}", "eps in the optimizer spec"),
    "optim_target_modules": _no("no GaLore / APOLLO optimizers"),
    "gradient_accumulation_steps": _same("a module option: Lightning's accumulate_grad_batches does not apply to "
                                         "manual optimisation"),
    "average_tokens_across_devices": _no("each loss type normalizes as TRL's GRPO does (dapo counts every rank's "
                                         "tokens) whatever this is"),
    "max_grad_norm": _same("a module option: Lightning's gradient_clip_val does not apply to manual optimisation"),
    "label_smoothing_factor": _no("no labels: the loss is the policy gradient"),
    "bf16": _renamed("Trainer(precision='bf16-mixed') or dtype='bfloat16'", _TRAINER),
    "fp16": _renamed("Trainer(precision='16-mixed')", _TRAINER),
    "bf16_full_eval": _renamed("Trainer(precision=...)", "validation runs at the training precision"),
    "fp16_full_eval": _renamed("Trainer(precision=...)", "validation runs at the training precision"),
    "tf32": _no("set torch.backends.cuda.matmul.allow_tf32 (or torch.set_float32_matmul_precision) yourself"),
    "activation_checkpointing": _renamed("the GradientCheckpointing callback"),
    "activation_checkpointing_kwargs": _renamed("GradientCheckpointing(...)"),
    "gradient_checkpointing": _renamed("the GradientCheckpointing callback"),
    "gradient_checkpointing_kwargs": _renamed("GradientCheckpointing(...)"),
    "torch_compile": _no("no torch.compile of the model"),
    "torch_compile_backend": _no("no torch.compile of the model"),
    "torch_compile_mode": _no("no torch.compile of the model"),
    "use_liger_kernel": _no("the chunked log-probabilities (loss_type='chunked', the default) already keep the "
                            "[tokens, vocab] logits out of memory, which is what Liger's fused kernel is for"),
    "liger_kernel_config": _no("no Liger kernels (see use_liger_kernel)"),
    "use_cache": _no("generation always uses the KV cache, training never"),
    "neftune_noise_alpha": _no("an SFT technique; no noise is added to embeddings"),
    "torch_empty_cache_steps": _no("the allocator is left alone (see the AllocatorSettings callback)"),
    "auto_find_batch_size": _no("it would split prompt groups (TRL's GRPO refuses it too); lit-memtrain plan sizes "
                                "the batch"),
    "logging_strategy": _renamed("Trainer(log_every_n_steps=...)", _TRAINER),
    "logging_steps": _renamed("Trainer(log_every_n_steps=...)", _TRAINER),
    "logging_first_step": _no("Lightning logs every log_every_n_steps"),
    "log_on_each_node": _no("Lightning logs from rank 0"),
    "logging_nan_inf_filter": _no("losses are logged as they are"),
    "include_num_input_tokens_seen": _renamed("train/tokens", "always logged (trained tokens)"),
    "log_level": _no("Python's logging configuration"),
    "log_level_replica": _no("Python's logging configuration"),
    "disable_tqdm": _renamed("Trainer(enable_progress_bar=False)", _TRAINER),
    "report_to": _renamed("Trainer(logger=...)", _LOGGER),
    "run_name": _renamed("the logger's name / version", _LOGGER),
    "project": _renamed("the logger's project", _LOGGER),
    "trackio_space_id": _no("no Trackio logger wiring; " + _LOGGER),
    "trackio_bucket_id": _no("no Trackio logger wiring; " + _LOGGER),
    "trackio_static_space_id": _no("no Trackio logger wiring; " + _LOGGER),
    "eval_strategy": _renamed("Trainer(val_check_interval=..., check_val_every_n_epoch=...)", _TRAINER),
    "eval_steps": _renamed("Trainer(val_check_interval=...)", _TRAINER),
    "eval_delay": _no("Lightning validates on its own schedule"),
    "per_device_eval_batch_size": _renamed("PromptDataModule(val_batch_size=...)", "counts prompts"),
    "prediction_loss_only": _no(_EVAL),
    "eval_on_start": _no("Lightning's sanity check runs validation batches before training (num_sanity_val_steps)"),
    "eval_do_concat_batches": _no(_EVAL),
    "eval_use_gather_object": _no(_EVAL),
    "eval_accumulation_steps": _no(_EVAL),
    "include_for_metrics": _no(_EVAL),
    "batch_eval_metrics": _no(_EVAL),
    "save_only_model": _renamed("ModelCheckpoint(save_weights_only=True)", _CHECKPOINT),
    "save_strategy": _renamed("ModelCheckpoint(every_n_train_steps=... / every_n_epochs=...)", _CHECKPOINT),
    "save_steps": _renamed("ModelCheckpoint(every_n_train_steps=...)", _CHECKPOINT),
    "save_on_each_node": _no("checkpoints are written as the strategy writes them"),
    "save_total_limit": _renamed("ModelCheckpoint(save_top_k=...)", _CHECKPOINT),
    "enable_jit_checkpoint": _no("no checkpoint on a termination signal"),
    "push_to_hub": _no(_NO_HUB),
    "hub_token": _no(_NO_HUB),
    "hub_private_repo": _no(_NO_HUB),
    "hub_model_id": _no(_NO_HUB),
    "hub_strategy": _no(_NO_HUB),
    "hub_always_push": _no(_NO_HUB),
    "hub_revision": _no(_NO_HUB),
    "load_best_model_at_end": _no("ModelCheckpoint(monitor=...) keeps the best checkpoint; it is not reloaded"),
    "metric_for_best_model": _renamed("ModelCheckpoint(monitor=...)", _CHECKPOINT),
    "greater_is_better": _renamed("ModelCheckpoint(mode='max' / 'min')", _CHECKPOINT),
    "ignore_data_skip": _no("a resumed run continues its data where it stopped"),
    "restore_callback_states_from_checkpoint": _no("Lightning always restores callback states"),
    "full_determinism": _renamed("Trainer(deterministic=True)", _TRAINER),
    "seed": _renamed("lightning.seed_everything(...) (lit-memtrain fit --seed_everything)"),
    "data_seed": _renamed("PromptDataModule(seed=...)", "the training shuffle's seed"),
    "use_cpu": _renamed("Trainer(accelerator='cpu')", _TRAINER),
    "accelerator_config": _no("no Accelerate: the Lightning Trainer runs the loop"),
    "parallelism_config": _renamed("Trainer(strategy=FSDP2Strategy(...))", "context parallelism is refused, as TRL's "
                                   "GRPO refuses it"),
    "dataloader_drop_last": _no("TRL's GRPO/RLOO sampler drops an epoch's incomplete generation batch whatever it "
                                "says; PromptDataModule(drop_last=True), the default, does the same"),
    "dataloader_num_workers": _renamed("PromptDataModule(num_workers=...)"),
    "dataloader_pin_memory": _no(_LOADER),
    "dataloader_persistent_workers": _no(_LOADER),
    "dataloader_prefetch_factor": _no(_LOADER),
    "dataloader_multiprocessing_context": _no(_LOADER),
    "dataloader_in_order": _no(_LOADER),
    "remove_unused_columns": _no("every dataset column reaches the reward functions (TRL's GRPO keeps them too)"),
    "label_names": _no("no labels"),
    "train_sampling_strategy": _no("prompts are shuffled (PromptDataModule(seed=...))"),
    "length_column_name": _no("no length-grouped sampling"),
    "ddp_find_unused_parameters": _no(_DDP),
    "ddp_bucket_cap_mb": _no(_DDP),
    "ddp_broadcast_buffers": _no(_DDP),
    "ddp_static_graph": _no(_DDP),
    "ddp_backend": _no(_DDP),
    "ddp_timeout": _no(_DDP),
    "fsdp": _renamed("Trainer(strategy=FSDP2Strategy(...))", "FSDP2 only"),
    "fsdp_config": _renamed("FSDP2Strategy(...)", "its own options (cpu_offload, ...)"),
    "deepspeed": _no("no DeepSpeed: FSDP2Strategy shards (ZeRO-3-like)"),
    "debug": _no("no debug modes"),
    "skip_memory_metrics": _no("the MemoryMonitor callback measures memory"),
    "do_train": _no("lit-memtrain fit / validate choose what runs"),
    "do_eval": _no("lit-memtrain fit / validate choose what runs"),
    "do_predict": _no("lit-memtrain fit / validate choose what runs"),
    "resume_from_checkpoint": _renamed("Trainer.fit(ckpt_path=...) (lit-memtrain fit --ckpt_path)"),
    "local_rank": _no("set by the launcher"),
    # --- the online RL fields of both configs
    "model_init_kwargs": _same(),
    "trust_remote_code": _same(),
    "router_aux_loss_coef": _same("a CausalLMModule option: the router load-balancing loss added as TRL adds it"),
    "disable_dropout": _same(),
    "cast_lm_head_to_fp32": _grpo("not under FSDP2, with a LoRA adapter on the head or a head tied to the embeddings"),
    "num_generations": _same(),
    "num_generations_eval": _same(),
    "max_completion_length": _same(),
    "ds3_gather_for_generation": _renamed("gather_weights_for_generation", "the same choice under FSDP2"),
    "shuffle_dataset": _no("training prompts are always shuffled (PromptDataModule(seed=...))"),
    "pad_to_multiple_of": _no("slices are scored padding-free (padding_free=False: right-padded to the longest)"),
    "generation_batch_size": _renamed(
        "PromptDataModule(batch_size=generation_batch_size / (num_generations x ranks)) and steps_per_generation="
        "generation_batch_size / (per_device_train_batch_size x ranks)",
        "TRL derives steps_per_generation from it and per_device_train_batch_size, which has no counterpart here: "
        "a generation batch is the datamodule's batch_size prompts per rank x num_generations, trained in "
        "steps_per_generation slices"),
    "steps_per_generation": _same(),
    "temperature": _same(),
    "top_p": _same(),
    "top_k": _same(),
    "min_p": _same(),
    "generation_kwargs": _same(),
    "chat_template_kwargs": _renamed("PromptDataModule(chat_template_kwargs=...)", "the datamodule renders prompts"),
    "repetition_penalty": _same(),
    "cache_implementation": _no("generation uses the backend's own cache"),
    "use_vllm": _renamed("generation_backend='vllm_colocate' / 'vllm_server'"),
    "vllm_mode": _renamed("generation_backend='vllm_colocate' / 'vllm_server'"),
    "vllm_model_impl": _no("vLLM's own implementation only"),
    "vllm_enable_sleep_mode": _renamed("generation_options={'sleep_level': ...}", "vllm_colocate sleeps (level 2) by "
                                       "default (TRL: off)"),
    "vllm_structured_outputs_regex": _no("no structured outputs"),
    "vllm_server_base_url": _renamed("generation_options={'base_url': ...}", "vllm_server"),
    "vllm_server_host": _renamed("generation_options={'base_url': ...}", "vllm_server"),
    "vllm_server_port": _renamed("generation_options={'base_url': ...}", "vllm_server"),
    "vllm_server_timeout": _renamed("generation_options={'connection_timeout': ...}", "vllm_server"),
    "vllm_group_port": _renamed("generation_options={'group_port': ...}", "vllm_server"),
    "vllm_gpu_memory_utilization": _renamed("generation_options={'gpu_memory_utilization': ...}", "vllm_colocate"),
    "vllm_max_model_length": _renamed("generation_options={'max_model_len': ...}", "vllm_colocate"),
    "vllm_tensor_parallel_size": _no("no tensor parallelism of a colocated engine"),
    "beta": _same(),
    "num_iterations": _same(),
    "epsilon": _same(),
    "epsilon_high": _same(),
    "reward_weights": _same(),
    "mask_truncated_completions": _same(),
    "sync_ref_model": _same("the frozen-copy reference (beta != 0, no LoRA); not under FSDP2"),
    "ref_model_mixup_alpha": _same(),
    "ref_model_sync_steps": _same(),
    "log_completions": _no("no completion tables; reward functions can log_metric(name, value)"),
    "log_multimodal": _no("text prompts only"),
    "num_completions_to_print": _no("no completion tables"),
    "log_unique_prompts": _no("no completion tables"),
    "use_transformers_continuous_batching": _renamed("generation_backend='transformers_continuous'"),
    "transformers_continuous_batching_config": _renamed("generation_options={...}", "transformers_continuous: "
                                                        "page_size, num_blocks, max_batch_tokens"),
    "use_transformers_paged": _renamed("generation_backend='transformers_continuous'", "deprecated in TRL"),
    # --- GRPOConfig only
    "delta": _grpo(),
    "sapo_temperature_neg": _grpo(),
    "sapo_temperature_pos": _grpo(),
    "vespo_k_pos": _grpo(),
    "vespo_lambda_pos": _grpo(),
    "vespo_k_neg": _grpo(),
    "vespo_lambda_neg": _grpo(),
    "importance_sampling_level": _grpo(),
    "multi_objective_aggregation": _grpo(),
    "scale_rewards": _grpo("True / False as TRL's ('group' / 'none')"),
    "loss_type": _renamed("policy_loss", "loss_type here is the house's way of scoring tokens ('chunked' / 'nll')",
                          "GRPOConfig"),
    "top_entropy_quantile": _grpo(),
    "entropy_coef": _grpo(),
    "use_adaptive_entropy": _grpo(),
    "entropy_coef_min": _grpo(),
    "entropy_coef_max": _grpo(),
    "entropy_coef_delta": _grpo(),
    "entropy_target": _grpo(),
    "max_tool_calling_iterations": _no("no tool calling", "GRPOConfig"),
    "vllm_importance_sampling_correction": _grpo("on with the vLLM backends, which report their sampling "
                                                 "log-probabilities; the others have nothing to correct"),
    "vllm_importance_sampling_mode": _grpo(),
    "vllm_importance_sampling_clip_max": _grpo(),
    "vllm_importance_sampling_clip_min": _grpo(),
    "vllm_importance_sampling_cap": _renamed("vllm_importance_sampling_clip_max", "TRL 1.16 deprecates the cap for it",
                                             "GRPOConfig"),
    "off_policy_mask_threshold": _grpo(),
    "use_bias_correction_kl": _grpo(),
    "log_completions_hub_repo": _no(_NO_HUB, "GRPOConfig"),
    # --- RLOOConfig only
    "normalize_advantages": _same("RLOOModule takes it (RLOO's baseline)", "RLOOConfig"),
    "reward_clip_range": _same("RLOOModule takes it (RLOO's baseline)", "RLOOConfig"),
}

_TRAINING_ARGUMENTS_END = "local_rank"  # the fields above it are TrainingArguments'


def _config_names(name: str) -> str:
    configs = TRL_FIELDS[name].configs
    owner = "GRPOConfig and RLOOConfig" if configs == "both" else configs
    names = list(TRL_FIELDS)
    if names.index(name) <= names.index(_TRAINING_ARGUMENTS_END):
        return f"a TrainingArguments field of {owner}"
    return f"a field of {owner}"


def refuse_trl_fields(module: str, kwargs: Mapping[str, Any]) -> None:
    """Raise a ValueError naming the first TRL field in ``kwargs`` (what ``module``'s own parameters did not take, on
    their way to :class:`~lit_memtrain.objectives.causal_lm.CausalLMModule`) and what to do instead: its new name or
    place, or why it is not offered. ``loss_type`` set to one of TRL's policy losses is refused too (``policy_loss``
    here). CausalLMModule's own parameters pass (TRL's ``learning_rate``, ``weight_decay``, ... mean the same), and
    names TRL does not have are left to it."""
    if kwargs.get("loss_type") in ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo"):
        raise ValueError(
            f"{module}: TRL's loss_type={kwargs['loss_type']!r} is policy_loss={kwargs['loss_type']!r} here; "
            "loss_type is the house's way of scoring tokens ('chunked' or 'nll')."
        )
    accepted = inspect.signature(CausalLMModule.__init__).parameters
    for name in kwargs:
        entry = TRL_FIELDS.get(name)
        if entry is None or name in accepted:
            continue
        where = _config_names(name)
        if entry.status == "renamed":
            why = f" ({entry.why})" if entry.why else ""
            raise ValueError(f"{module} has no {name} ({where} of TRL 1.16): use {entry.ours}{why}.")
        if entry.status == "not offered":
            raise ValueError(f"{module} does not offer TRL's {name} ({where}): {entry.why}.")
        reason = entry.why or "see the option table in docs/online_rl.md"
        raise ValueError(f"{module} does not take TRL's {name} ({where}): {reason}.")
