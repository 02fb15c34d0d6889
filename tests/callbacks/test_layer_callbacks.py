"""Callbacks that act on decoder layers refuse a LightningModule that has none, with a clear message."""

import lightning.pytorch as L
import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lit_memtrain.callbacks import ActivationOffloading, GradientCheckpointing, TiledMLP


class NoLayersModule(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(4, 1)

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        return self.head(batch[0]).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize(
    ("callback", "message"),
    [
        (GradientCheckpointing(), "GradientCheckpointing has no layers to checkpoint: Could not find decoder layers in NoLayersModule"),
        (TiledMLP(), "TiledMLP has no decoder layers to tile: Could not find decoder layers in NoLayersModule"),
        (ActivationOffloading(offload_cpu_tensors_for_testing=True), "Could not find decoder layers in NoLayersModule"),
    ],
)
def test_module_without_decoder_layers_is_a_clear_error(callback, message):
    trainer = L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_progress_bar=False, callbacks=[callback])
    data = DataLoader(TensorDataset(torch.randn(2, 4)), batch_size=2)
    with pytest.raises(ValueError, match=message):
        trainer.fit(NoLayersModule(), data)
