"""Shared fixtures: offline hub, the embedded tokenizer in a per-session directory."""

from __future__ import annotations

import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("LIT_MEMTRAIN_HOME", tempfile.mkdtemp(prefix="lit-memtrain-test-"))

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tokenizer():
    from lit_memtrain.datamodules.embedded import EMBEDDED
    from lit_memtrain.datamodules.tokenizer import load_tokenizer

    return load_tokenizer(EMBEDDED)
