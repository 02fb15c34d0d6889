"""``benchmarks/sweep_grid.py``: the W&B sweep's search space as a local grid, its points the sweep's keys and values
(the objective line it reads: tests/e2e/test_wandb_sweep.py; the runs themselves: ``make docs-check`` runs
docs/sweeps.md's grid)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("sweep_grid", ROOT / "benchmarks" / "sweep_grid.py")
sweep_grid = sys.modules.setdefault("sweep_grid", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(sweep_grid)
SWEPT = yaml.safe_load((ROOT / "configs" / "sweep.yaml").read_text())["parameters"]


def test_the_grid_is_every_categorical_value_of_the_sweep_without_duplicate_runs():
    points = sweep_grid.grid({})
    categorical = [key for key, spec in SWEPT.items() if "values" in spec]
    swept = {"data.packing", "model.attn_implementation", "model.loss_chunk_size", "trainer.callbacks+"}
    assert set(categorical) == swept
    assert len(points) == 2 * 2 * 3 * 5 - 3 * 5  # sdpa_by_document without packing is plain sdpa: left out
    for key in categorical:
        assert {point[key] for point in points} == {sweep_grid._text(value) for value in SWEPT[key]["values"]}
    assert len({tuple(sorted(point.items())) for point in points}) == len(points)


def test_fixed_keys_hold_one_value_and_an_unknown_key_is_named():
    points = sweep_grid.grid({"data.packing": "true", "model.loss_chunk_size": "1024"})
    assert len(points) == 2 * 5
    assert all(point["data.packing"] == "true" and point["model.loss_chunk_size"] == "1024" for point in points)
    with pytest.raises(SystemExit, match="model.lerning_rate is not a key of sweep.yaml"):
        sweep_grid.grid({"model.lerning_rate": "1e-4"})

