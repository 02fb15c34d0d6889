"""Fixtures of the command-line tests: the info lines Lightning's ``rank_zero_info`` logs."""

from __future__ import annotations

import logging

import pytest

from lit_memtrain.cli.library_noise import RANK_ZERO_LOGGER


@pytest.fixture
def info_lines():
    """The lines Lightning's ``rank_zero_info`` logs while the test runs, as a user sees them."""
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger(RANK_ZERO_LOGGER)
    logger.addHandler(handler)
    yield lines
    logger.removeHandler(handler)
