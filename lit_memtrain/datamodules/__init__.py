"""Data: tokenization and loss masks, collation, packing and the length profiler."""

from lit_memtrain.datamodules.collate import PaddedCollator
from lit_memtrain.datamodules.sft import SFTDataModule

__all__ = ["PaddedCollator", "SFTDataModule"]
