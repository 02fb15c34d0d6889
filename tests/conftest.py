"""Shared fixtures: offline hub, the embedded tokenizer in a per-session directory, the preloaded Python.

A test module may define ``start_early(preloaded_python)``, which queues (``preloaded_python.start``) the runs its
tests will make: when collection ends, it is called for every module with a selected test, and those modules run
last, so that their runs go on in the background, one at a time, while the other tests run (see
``preloaded_python``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("LIT_MEMTRAIN_HOME", tempfile.mkdtemp(prefix="lit-memtrain-test-"))

import pytest  # noqa: E402
from preloaded_python import PreloadedPython  # noqa: E402

# What `lit-memtrain plan` and the simulations import: loaded once, before any script is forked.
PRELOADED = (
    "torch", "transformers", "lightning.pytorch", "lit_memtrain", "lit_memtrain.cli", "lit_memtrain.cli.plan",
    "lit_memtrain.planner.command", "lit_memtrain.planner.plan", "lit_memtrain.planner.simulate",
)  # fmt: skip
_PYTHON = pytest.StashKey[PreloadedPython]()


def _started_early(item: pytest.Item):
    return getattr(getattr(item, "module", None), "start_early", None)


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_PYTHON] = PreloadedPython(PRELOADED, Path(tempfile.mkdtemp(prefix="lit-memtrain-python-")))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: _started_early(item) is not None)  # stable: the order stays within each part


def pytest_collection_finish(session: pytest.Session) -> None:
    if session.config.option.collectonly:
        return
    started = set()
    for item in session.items:
        start_early = _started_early(item)
        if start_early is not None and start_early not in started:
            started.add(start_early)
            start_early(session.config.stash[_PYTHON])


def pytest_unconfigure(config: pytest.Config) -> None:
    python = config.stash[_PYTHON]
    python.close()
    shutil.rmtree(python.directory, ignore_errors=True)


@pytest.fixture(scope="session")
def tokenizer():
    from lit_memtrain.datamodules.embedded import EMBEDDED
    from lit_memtrain.datamodules.tokenizer import load_tokenizer

    return load_tokenizer(EMBEDDED)


@pytest.fixture(scope="session")
def preloaded_python(pytestconfig: pytest.Config) -> PreloadedPython:
    """Runs ``python -c``/``-m`` scripts as fresh processes (the planner's stand-in device must be registered
    before a process's first backward) without paying the imports again for each: see ``preloaded_python``."""
    return pytestconfig.stash[_PYTHON]


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory) -> Path:
    """A GGUF file of ``gguf_writer.tiny_llama()`` (seed 0) and the embedded tokenizer, alone in its directory."""
    from gguf_writer import write_tiny_gguf

    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")
