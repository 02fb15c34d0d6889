"""lit-memtrain: memory-reduction techniques for fine-tuning causal LMs with PyTorch Lightning."""

from lit_memtrain.layers import find_decoder_layers
from lit_memtrain.presets import PRESETS, build_config

__all__ = ["PRESETS", "build_config", "find_decoder_layers"]
__version__ = "0.1.0"
