"""ContextParallelStrategy refuses, when its attention is installed and before any batch, a model that mixes tokens
along the sequence outside its attention: each rank would run those layers on its shard alone (2 gloo ranks)."""

from __future__ import annotations

from pathlib import Path

import torch
from gloo_ranks import run_on_gloo_ranks
from lightning.pytorch import Callback, Trainer
from torch.utils.data import DataLoader

from lit_memtrain.datamodules.padding_free import PaddingFreeCollator
from lit_memtrain.objectives.causal_lm import CausalLMModule
from lit_memtrain.strategies import ContextParallelStrategy

# A Mamba layer, then an attention layer: the attention keeps packed documents apart, the Mamba layer carries state.
BAMBA = {"model_type": "bamba", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "mamba_n_heads": 4, "mamba_d_head": 16, "mamba_d_state": 8,
         "attn_layer_indices": [1], "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}  # fmt: skip
QWEN3 = {"model_type": "qwen3", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "pad_token_id": 0, "bos_token_id": 1,
         "eos_token_id": 2}  # fmt: skip
CASES = [("bamba", "ulysses"), ("bamba", "ring"), ("qwen3", "ulysses"), ("qwen3", "ring")]


def _fit(config: dict, method: str, root: Path, precision: str = "32-true", callbacks: tuple = ()) -> CausalLMModule:
    torch.manual_seed(0)
    module = CausalLMModule(config=config, attn_implementation="sdpa_by_document", warmup=0)
    generator = torch.Generator().manual_seed(1)
    documents = [{"input_ids": ids, "labels": ids} for ids in (torch.randint(3, 64, (n,), generator=generator).tolist()
                                                              for n in (9, 7))]  # fmt: skip
    rows = DataLoader([PaddingFreeCollator(pad_token_id=0)(documents)], batch_size=None)
    trainer = Trainer(
        accelerator="cpu", devices=2, strategy=ContextParallelStrategy(2, method=method), precision=precision,
        max_steps=1, logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        num_sanity_val_steps=0, use_distributed_sampler=False, default_root_dir=root, callbacks=list(callbacks),
    )  # fmt: skip
    trainer.fit(module, rows)
    return module


def _worker(rank: int, out: Path) -> None:
    for model, method in CASES:
        try:
            module = _fit(BAMBA if model == "bamba" else QWEN3, method, out / f"{model}-{method}")
            result = f"trained {module.first_train_loss is not None}"
        except ValueError as error:
            result = f"refused: {error}"
        (out / f"{model}-{method}.rank{rank}.txt").write_text(result)


def test_a_mamba_hybrid_is_refused_before_training_and_a_transformer_trains(tmp_path):
    """Bamba under ContextParallelStrategy trained, silently, on a second shard whose Mamba state started from zero
    (the module's document probe is skipped for context-parallel attention, and nothing else looked)."""
    run_on_gloo_ranks(_worker, (tmp_path,), world=2, errors=tmp_path, timeout_s=500)
    for model, method in CASES:
        for rank in range(2):
            result = (tmp_path / f"{model}-{method}.rank{rank}.txt").read_text()
            if model == "qwen3":
                assert result == "trained True", (method, rank, result)
                continue
            assert result.startswith("refused: BambaForCausalLM computes something else on a row split over 2 "), result
            assert "from token 8 (the first after a shard boundary is 8)" in result, result
            assert "Train it without context parallelism (FSDP2Strategy" in result, result


class _FirstForwardDtype(Callback):
    """Records the dtype of the logits of the model's first forward after training starts: the strategy's split probe,
    which runs right after the callbacks' and the module's on_train_start."""

    def __init__(self) -> None:
        self.dtypes: list[torch.dtype] = []

    def on_train_start(self, trainer: Trainer, pl_module: CausalLMModule) -> None:
        def record(module: torch.nn.Module, args: tuple, kwargs: dict, output: object) -> None:
            self.dtypes.append(output.logits.dtype)
            handle.remove()

        handle = pl_module.model.register_forward_hook(record, with_kwargs=True)


def _bf16_mixed_worker(rank: int, out: Path) -> None:
    probe = _FirstForwardDtype()
    module = _fit(QWEN3, "ulysses", out, "bf16-mixed", (probe,))
    (out / f"rank{rank}.txt").write_text(f"{probe.dtypes} {module.first_train_loss is not None}")


def test_the_split_probe_computes_in_the_dtype_a_bf16_mixed_step_computes_in(tmp_path):
    """Under precision="bf16-mixed" the probe ran outside autocast, in the fp32 weights' dtype, which flash-attn's
    kernels refuse (inner="flash_attention_2"): a fit that trains in bf16 failed at its start on CUDA."""
    run_on_gloo_ranks(_bf16_mixed_worker, (tmp_path,), world=2, errors=tmp_path, timeout_s=300)
    for rank in range(2):
        assert (tmp_path / f"rank{rank}.txt").read_text() == "[torch.bfloat16] True"
