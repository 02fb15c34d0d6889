"""ChunkedRMSNorm in a Lightning fit: the same losses and weights as without it; clear errors where it cannot act."""

from __future__ import annotations

import lightning.pytorch as L
import pytest
import torch
from equivalence import TINY_MODEL_TERMS, assert_equal_up_to_rounding
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset
from transformers import AutoModelForCausalLM, GemmaConfig, Olmo2Config

from lit_memtrain.callbacks import ChunkedRMSNorm, GradientCheckpointing, TiledMLP
from lit_memtrain.models.presets import build_config


class UserModule(L.LightningModule):
    """A user's own LightningModule holding an HF causal LM, trained with its built-in loss."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.losses: list[float] = []

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        loss = self.model(input_ids=batch[0], labels=batch[0]).loss
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)  # AdamW would amplify fp32 rounding of tiny gradients


def _model(preset: str) -> nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(build_config(preset))


def _fit(module: L.LightningModule, callbacks: list[L.Callback], precision: str = "32-true") -> None:
    data = torch.randint(0, 512, (6, 40), generator=torch.Generator().manual_seed(2))
    trainer = L.Trainer(
        max_steps=3, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks, precision=precision,
    )  # fmt: skip
    trainer.fit(module, DataLoader(TensorDataset(data), batch_size=2))


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-llama"])
def test_a_fit_with_chunked_norms_equals_a_fit_without(preset):
    plain = UserModule(_model(preset))
    _fit(plain, [GradientCheckpointing(), TiledMLP(num_tiles=2)])
    chunked = UserModule(_model(preset))
    norms = [m for m in chunked.model.modules() if type(m).__name__.endswith("RMSNorm")]
    called = []
    record = lambda module, args, out: called.append(out.grad_fn and out.grad_fn.name())  # noqa: E731
    handles = [norm.register_forward_hook(record) for norm in norms]
    _fit(chunked, [GradientCheckpointing(), TiledMLP(num_tiles=2), ChunkedRMSNorm(chunk_elements=64 * 7)])
    for handle in handles:
        handle.remove()
    names = set(called) - {None}  # checkpointing's first forward runs without autograd
    assert names == {"_ChunkedRMSNormBackward"}
    assert_equal_up_to_rounding(chunked.losses, plain.losses, name="losses", terms=TINY_MODEL_TERMS)
    for (name, expected), got in zip(plain.model.named_parameters(), chunked.model.parameters()):
        assert_equal_up_to_rounding(got, expected, name=name, terms=TINY_MODEL_TERMS)  # SGD: at the weights' scale
    assert all("forward" not in vars(norm) for norm in norms)  # restored after fit


def test_a_model_without_replaceable_norms_is_a_clear_error():
    config = GemmaConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16)  # fmt: skip
    with pytest.raises(ValueError, match="cannot prove any of the model's norms equal.*GemmaRMSNorm.*variance_eps"):
        _fit(UserModule(AutoModelForCausalLM.from_config(config)), [ChunkedRMSNorm()])


def _olmo2() -> nn.Module:
    torch.manual_seed(0)
    config = Olmo2Config(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    return AutoModelForCausalLM.from_config(config)


def test_a_norm_that_applies_its_weight_in_fp32_is_chunked_in_a_pure_fp32_fit_and_refused_under_bf16_mixed():
    """OLMo 2's norm multiplies by its weight in fp32 before casting back: on fp32 inputs that is the chunked norm
    (the fit's losses and weights are the plain fit's), under bf16-mixed its q/k norms get bf16 inputs and round
    after the weight. The probe checked half-precision inputs for every fit, and refused the fp32 fit too."""
    plain = UserModule(_olmo2())
    _fit(plain, [])
    chunked = UserModule(_olmo2())
    called = []
    norms = [m for m in chunked.model.modules() if type(m).__name__ == "Olmo2RMSNorm"]
    record = lambda module, args, out: out.grad_fn and called.append(out.grad_fn.name())  # noqa: E731
    handles = [norm.register_forward_hook(record) for norm in norms]
    _fit(chunked, [ChunkedRMSNorm(chunk_elements=64 * 7)])
    for handle in handles:
        handle.remove()
    assert called == ["_ChunkedRMSNormBackward"] * (3 * len(norms))  # every norm, every step (the probe's: no grad)
    assert_equal_up_to_rounding(chunked.losses, plain.losses, name="losses", terms=TINY_MODEL_TERMS)
    for (name, expected), got in zip(plain.model.named_parameters(), chunked.model.parameters()):
        assert_equal_up_to_rounding(got, expected, name=name, terms=TINY_MODEL_TERMS)
    mixed = UserModule(_olmo2())
    message = "Olmo2RMSNorm: its output differs .* on torch.bfloat16 inputs with a torch.float32 weight"
    with pytest.raises(ValueError, match=message):
        _fit(mixed, [ChunkedRMSNorm()], precision="bf16-mixed")
    assert mixed.losses == []


def test_a_module_without_norms_and_bad_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="found no RMSNorm module"):
        _fit(UserModule(nn.Linear(4, 4)), [ChunkedRMSNorm()])
    with pytest.raises(ValueError, match="chunk_elements must be a positive int"):
        ChunkedRMSNorm(chunk_elements=-1)
