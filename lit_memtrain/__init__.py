"""lit-memtrain: memory-reduction techniques for fine-tuning causal LMs with PyTorch Lightning."""

from lit_memtrain.datamodules.preference import PreferenceDataModule
from lit_memtrain.datamodules.sft import SFTDataModule
from lit_memtrain.dpo import DPOModule
from lit_memtrain.layers import find_decoder_layers
from lit_memtrain.loss import chunked_cross_entropy, cross_entropy
from lit_memtrain.module import CausalLMModule
from lit_memtrain.presets import PRESETS, build_config

__all__ = [
    "PRESETS",
    "CausalLMModule",
    "DPOModule",
    "PreferenceDataModule",
    "SFTDataModule",
    "build_config",
    "chunked_cross_entropy",
    "cross_entropy",
    "find_decoder_layers",
]
__version__ = "0.1.0"
