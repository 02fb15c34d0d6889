"""lit-memtrain: memory-reduction techniques for fine-tuning causal LMs with PyTorch Lightning."""

from lit_memtrain import moved
from lit_memtrain.datamodules.preference import PreferenceDataModule
from lit_memtrain.datamodules.sft import SFTDataModule
from lit_memtrain.objectives.dpo import DPOModule
from lit_memtrain.objectives.grpo import GRPOModule
from lit_memtrain.objectives.online_dpo import OnlineDPOModule
from lit_memtrain.objectives.rloo import RLOOModule
from lit_memtrain.models.layers import find_decoder_layers
from lit_memtrain.techniques.loss import chunked_cross_entropy, cross_entropy
from lit_memtrain.objectives.causal_lm import CausalLMModule
from lit_memtrain.objectives.reward import RewardModule
from lit_memtrain.models.presets import PRESETS, build_config

__all__ = [
    "PRESETS",
    "CausalLMModule",
    "DPOModule",
    "GRPOModule",
    "OnlineDPOModule",
    "PreferenceDataModule",
    "RLOOModule",
    "RewardModule",
    "SFTDataModule",
    "build_config",
    "chunked_cross_entropy",
    "cross_entropy",
    "find_decoder_layers",
]
__version__ = "0.1.0"

moved.install()
