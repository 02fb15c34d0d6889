"""Allocator settings: expandable segments set before CUDA starts, user settings kept, a warning when too late."""

from __future__ import annotations

import os

import pytest
import torch

from lit_memtrain.techniques.allocator import ALLOC_CONF_VARIABLES, EXPANDABLE_SEGMENTS, enable_expandable_segments
from lit_memtrain.callbacks.allocator_settings import AllocatorSettings


def test_sets_both_variables_when_unset():
    environ = {"PATH": "/bin"}
    assert enable_expandable_segments(environ) is True
    assert environ == {
        "PATH": "/bin",
        "PYTORCH_CUDA_ALLOC_CONF": EXPANDABLE_SEGMENTS,
        "PYTORCH_ALLOC_CONF": EXPANDABLE_SEGMENTS,
    }


@pytest.mark.parametrize("name", ALLOC_CONF_VARIABLES)
@pytest.mark.parametrize("value", ["max_split_size_mb:128", ""])
def test_keeps_any_user_setting(name, value):
    environ = {name: value}
    assert enable_expandable_segments(environ) is False
    assert environ == {name: value}


@pytest.fixture
def clean_environ(monkeypatch):
    for name in ALLOC_CONF_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_defaults_to_the_process_environment(clean_environ):
    assert enable_expandable_segments() is True
    assert [os.environ[name] for name in ALLOC_CONF_VARIABLES] == [EXPANDABLE_SEGMENTS] * 2


def test_callback_sets_variables_before_cuda_starts(clean_environ):
    clean_environ.setattr(torch.cuda, "is_initialized", lambda: False)
    callback = AllocatorSettings()
    assert callback.applied is True
    assert [os.environ[name] for name in ALLOC_CONF_VARIABLES] == [EXPANDABLE_SEGMENTS] * 2


def test_callback_warns_when_cuda_already_started(clean_environ):
    clean_environ.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.warns(UserWarning, match="CUDA is already initialised"):
        callback = AllocatorSettings()
    assert callback.applied is False
    assert not any(name in os.environ for name in ALLOC_CONF_VARIABLES)


def test_callback_keeps_user_setting_silently(clean_environ, recwarn):
    clean_environ.setenv("PYTORCH_ALLOC_CONF", "max_split_size_mb:64")
    clean_environ.setattr(torch.cuda, "is_initialized", lambda: True)
    callback = AllocatorSettings()
    assert callback.applied is False
    assert os.environ["PYTORCH_ALLOC_CONF"] == "max_split_size_mb:64"
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ
    assert not [w for w in recwarn if "AllocatorSettings" in str(w.message)]
