"""ContextParallelStrategy's arguments, mesh and head-count checks and command-line parsing: everything that must
fail (or parse) before any process group exists."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from lightning.pytorch import Trainer

from lit_memtrain.cli import MemTrainCLI
from lit_memtrain.datamodules.sft import SFTDataModule
from lit_memtrain.objectives.causal_lm import CausalLMModule
from lit_memtrain.strategies import ContextParallelStrategy


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"context_parallel_size": 0}, "context_parallel_size must be a positive int, got 0"),
        ({"context_parallel_size": 2, "method": "zigzag"}, "method must be one of 'ulysses', 'ring', got 'zigzag'"),
        ({"context_parallel_size": 2, "inner": "eager"}, r"inner must be one of \['flash_attention_2', 'sdpa', 'sdpa_"),
        ({"context_parallel_size": 2, "ring_backend": "nccl"}, r"ring_backend must be one of \('all_gather', 'torch'\)"),
        ({"context_parallel_size": 2, "ring_backend": "torch"}, "ring_backend='torch' is a ring kernel; it needs method"),
        ({"context_parallel_size": 2, "tensor_parallel_size": 2}, "tensor parallelism"),
    ],
)
def test_bad_arguments_are_refused_when_the_strategy_is_made(options, message):
    with pytest.raises(ValueError, match=message):
        ContextParallelStrategy(**options)


def test_a_context_parallel_size_that_does_not_divide_the_world_fails_when_the_trainer_is_made():
    with pytest.raises(ValueError, match=r"context_parallel_size=3 does not divide the world size 4.*Use one of \[1, 2, 4\]"):
        Trainer(accelerator="cpu", devices=2, num_nodes=2, strategy=ContextParallelStrategy(3), logger=False)


def test_a_data_parallel_size_that_does_not_fill_the_world_fails_when_the_trainer_is_made():
    with pytest.raises(ValueError, match="the data-parallel size must be 2"):
        Trainer(accelerator="cpu", devices=4, strategy=ContextParallelStrategy(2, data_parallel_size=4), logger=False)


def test_the_mesh_puts_context_parallel_innermost_and_the_rest_in_data_parallel():
    trainer = Trainer(accelerator="cpu", devices=2, num_nodes=2, strategy=ContextParallelStrategy(2), logger=False)
    assert list(trainer.strategy.mesh_shape().items()) == [("data_parallel", 2), ("context_parallel", 2)]


@pytest.mark.parametrize(
    ("overrides", "method", "message"),
    [
        ({"num_attention_heads": 3, "num_key_value_heads": 1}, "ulysses", r"num_attention_heads \(3\).*Sizes that work for this model: \[1, 3\]"),
        ({"num_attention_heads": 6, "num_key_value_heads": 3}, "ulysses", r"num_key_value_heads \(3\).*\[1, 3, 6\]"),
    ],
)
def test_heads_the_method_cannot_split_fail_before_any_process_group_or_weight(overrides, method, message):
    module = CausalLMModule(preset="tiny-qwen3", config_overrides={**overrides, "head_dim": 16})
    strategy = ContextParallelStrategy(2, method=method, start_method="fork")
    trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False)
    trainer.strategy.connect(module)
    with pytest.raises(ValueError, match=message):
        trainer.strategy.setup_environment()
    assert not dist.is_initialized() and module.model is None


def test_torch_ring_kernels_off_cuda_fail_before_any_process_group():
    strategy = ContextParallelStrategy(2, method="ring", ring_backend="torch", start_method="fork")
    trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False)
    trainer.strategy.connect(CausalLMModule(preset="tiny-qwen3"))
    with pytest.raises(ValueError, match="ring_backend='torch' runs torch's ring kernels, on CUDA only; this run is on cpu"):
        trainer.strategy.setup_environment()
    assert not dist.is_initialized()


def test_the_command_line_sets_the_strategy_and_its_options(tokenizer):
    cli = MemTrainCLI(
        CausalLMModule,
        SFTDataModule,
        run=False,
        args=[
            "--model.preset=tiny-qwen3",
            "--data.tokenizer=lit-memtrain/embedded",
            "--trainer.accelerator=cpu",
            "--trainer.devices=2",
            "--trainer.logger=false",
            "--trainer.strategy=lit_memtrain.strategies.ContextParallelStrategy",
            "--trainer.strategy.context_parallel_size=2",
            "--trainer.strategy.method=ring",
            "--trainer.strategy.cpu_offload=true",
            "--trainer.strategy.mixed_precision=bf16",
        ],
    )
    strategy = cli.trainer.strategy
    assert isinstance(strategy, ContextParallelStrategy)
    assert (strategy.context_parallel_size, strategy.method, strategy.ring_backend) == (2, "ring", "all_gather")
    assert strategy.cpu_offload and strategy.mp_policy is not None
    assert strategy.mesh_shape() == {"data_parallel": 1, "context_parallel": 2}


def test_a_router_load_balancing_loss_is_refused_and_a_zero_coefficient_accepted():
    """Each rank would compute the (non-additive) load-balancing loss on its shard only: not one process's loss."""
    from transformers import AutoModelForCausalLM

    from lit_memtrain.models.presets import build_config

    moe = {"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
           "router_aux_loss_coef": 0.5, "head_dim": 16}
    for coefficient, raises in ((None, True), (0.0, False)):
        module = CausalLMModule(preset="tiny-qwen3", config_overrides=moe, router_aux_loss_coef=coefficient)
        strategy = ContextParallelStrategy(2, start_method="fork")
        trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False)
        trainer.strategy.connect(module)
        model = AutoModelForCausalLM.from_config(build_config("tiny-qwen3", moe))
        if raises:
            with pytest.raises(ValueError, match=r"router load-balancing loss \(router_aux_loss_coef=0.5\).*router_aux_loss_coef=0"):
                strategy.parallelize(model)
        else:
            strategy._check_no_router_loss(model)  # parallelize itself would need the process group
