"""Data: tokenization and loss masks, collation, packing and the length profiler."""

from lit_memtrain.datamodules.collate import PaddedCollator
from lit_memtrain.datamodules.length_profile import LengthProfile, profile_lengths, recommend_max_length, write_histogram
from lit_memtrain.datamodules.padding_free import PaddingFreeCollator
from lit_memtrain.datamodules.preference import PreferenceDataModule
from lit_memtrain.datamodules.prompts import PromptDataModule
from lit_memtrain.datamodules.sft import SFTDataModule

__all__ = [
    "LengthProfile",
    "PaddedCollator",
    "PaddingFreeCollator",
    "PreferenceDataModule",
    "PromptDataModule",
    "SFTDataModule",
    "profile_lengths",
    "recommend_max_length",
    "write_histogram",
]
