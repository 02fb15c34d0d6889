"""FSDP2Strategy's arguments, mesh checks and command-line parsing: everything that must fail (or parse)
before any process starts."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import MixedPrecisionPolicy

from lit_memtrain.cli import MemTrainCLI
from lit_memtrain.datamodules.sft import SFTDataModule
from lit_memtrain.objectives.causal_lm import CausalLMModule
from lit_memtrain.strategies import FSDP2Strategy
from lit_memtrain.parallel.fsdp import run_inside_forward


def test_tensor_parallelism_is_refused_when_the_strategy_is_made():
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 \(tensor parallelism\) is not supported"):
        FSDP2Strategy(tensor_parallel_size=2)


@pytest.mark.parametrize("size", [1, 3])
def test_a_data_parallel_size_other_than_the_world_size_fails_when_the_trainer_is_made(size):
    with pytest.raises(ValueError, match=rf"data_parallel_size={size}\) does not match the world size 2"):
        Trainer(accelerator="cpu", devices=2, strategy=FSDP2Strategy(data_parallel_size=size, start_method="fork"))


def test_the_data_parallel_size_defaults_to_every_device_of_every_node():
    trainer = Trainer(accelerator="cpu", devices=2, num_nodes=2, strategy=FSDP2Strategy(), logger=False)
    assert trainer.strategy.mesh_shape() == {"data_parallel": 4}


@pytest.mark.parametrize(
    ("value", "param_dtype", "reduce_dtype"),
    [
        ("bf16", torch.bfloat16, torch.float32),
        ("bfloat16", torch.bfloat16, torch.float32),
        ({"param_dtype": "bfloat16", "reduce_dtype": "bfloat16"}, torch.bfloat16, torch.bfloat16),
        (MixedPrecisionPolicy(param_dtype=torch.bfloat16), torch.bfloat16, None),
        (None, None, None),
    ],
)
def test_mixed_precision_names_the_dtypes_of_compute_and_reduction(value, param_dtype, reduce_dtype):
    policy = FSDP2Strategy(mixed_precision=value).mp_policy
    if value is None:
        assert policy is None
    else:
        assert (policy.param_dtype, policy.reduce_dtype) == (param_dtype, reduce_dtype)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("fp16", "float16 needs loss scaling"),
        ("int8", "'int8' is not a dtype name"),
        ({"param": "bf16"}, r"unknown fields \['param'\]"),
        (16, "must be a dtype name"),
    ],
)
def test_bad_mixed_precision_is_refused(value, message):
    with pytest.raises((ValueError, TypeError), match=message):
        FSDP2Strategy(mixed_precision=value)


def test_the_command_line_sets_the_strategy_and_its_options(tokenizer):
    cli = MemTrainCLI(
        CausalLMModule,
        SFTDataModule,
        run=False,
        args=[
            "--model.preset=tiny-qwen3",
            "--data.tokenizer=lit-memtrain/embedded",
            "--trainer.accelerator=cpu",
            "--trainer.devices=1",
            "--trainer.logger=false",
            "--trainer.strategy=lit_memtrain.strategies.FSDP2Strategy",
            "--trainer.strategy.mixed_precision=bf16",
            "--trainer.strategy.cpu_offload=true",
            "--trainer.strategy.reshard_after_forward=false",
        ],
    )
    strategy = cli.trainer.strategy
    assert isinstance(strategy, FSDP2Strategy)
    assert (strategy.mp_policy.param_dtype, strategy.mp_policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert strategy.cpu_offload and not strategy.reshard_after_forward
    assert strategy.mesh_shape() == {"data_parallel": 1}


def test_the_module_refuses_model_parallel_strategies_it_cannot_parallelise():
    module = CausalLMModule(preset="tiny-qwen3")
    module.trainer = Trainer(accelerator="cpu", devices=1, strategy=ModelParallelStrategy(), logger=False)
    with pytest.raises(TypeError, match="use lit_memtrain.strategies.FSDP2Strategy"):
        module.configure_model()


def test_run_inside_forward_calls_the_function_through_the_module_hooks_and_restores_forward():
    layer = torch.nn.Linear(2, 2)
    seen = []
    layer.register_forward_pre_hook(lambda module, args: seen.append(args))
    assert run_inside_forward(layer, lambda x: x * 2, torch.ones(1)).item() == 2.0
    assert len(seen) == 1 and "forward" not in vars(layer)
    assert layer(torch.ones(2)).shape == (2,)


def test_with_cpu_offload_everything_but_the_sharded_parameters_follows_the_device():
    """What ``model_to_device`` does with cpu_offload, shown with ``meta`` as the device: the kept module's
    parameters stay in host memory, its buffers, the metric states and the LightningModule's device move."""
    from lightning.pytorch import LightningModule
    from torchmetrics import MeanMetric

    from lit_memtrain.strategies.fsdp2 import _to_device_except

    class Module(LightningModule):
        def __init__(self):
            super().__init__()
            self.metric = MeanMetric()
            self.sharded = torch.nn.Linear(2, 2)
            self.sharded.register_buffer("frequencies", torch.ones(2), persistent=False)
            self.other = torch.nn.Linear(2, 2)

    module = Module()
    _to_device_except(module, torch.device("meta"), [module.sharded])
    assert module.sharded.weight.device.type == "cpu" and module.sharded.frequencies.device.type == "meta"
    assert module.other.weight.device.type == "meta" and module.metric.mean_value.device.type == "meta"
    assert module.device.type == "meta" and module.sharded is module._modules["sharded"]


@pytest.mark.parametrize(
    ("device", "kwargs", "backend"),
    [
        ("cuda", {"cpu_offload": True}, "cuda:nccl,cpu:gloo"),  # the gradient norm of clipping is a host tensor
        ("cuda", {"cpu_offload": False}, "nccl"),
        ("cpu", {"cpu_offload": True}, "gloo"),
        ("cuda", {"cpu_offload": True, "process_group_backend": "nccl"}, "nccl"),  # the user's choice is kept
    ],
)
def test_cpu_offload_on_cuda_gives_host_tensors_a_gloo_backend_unless_one_is_named(device, kwargs, backend):
    """What ``setup_environment`` would initialise for a CUDA root device, asked on the CPU (no CUDA is touched:
    a device object is only a name). NCCL alone fails in ``clip_grad_norm_`` when cpu_offload keeps gradients
    on the host."""
    trainer = Trainer(accelerator="cpu", devices=1, strategy=FSDP2Strategy(**kwargs), logger=False)
    strategy = trainer.strategy
    strategy.parallel_devices = [torch.device(device, 0)]
    assert strategy._get_process_group_backend() == backend
    assert not torch.cuda.is_initialized()
