"""What a part of the GPU check writes: one JSON file that ``check.py`` collects into report.json and report.md.

A part is a script in this folder that takes ``--json PATH`` (write the results there) and ``--dry-run``
(tiny shapes on the CPU: the same code paths where they exist there, so the script cannot rot between GPU
runs; its figures mean nothing). It exits non-zero when one of its checks fails, after writing the JSON.
Scripts import this module as ``results`` (their own folder is first on ``sys.path``).

The JSON object::

    {"summary": "one line",
     "tables": [{"title": "...", "columns": ["setting", "peak GiB", "peak ratio"], "rows": [["a", 1.5, 1.0]]}],
     "checks": [{"name": "gradients equal with offloading", "passed": true, "detail": "max rel diff 1e-4"}],
     "config": {"seq_len": 32768}}

Figures go in the tables as measured; ratios against a baseline measured side by side in the same run
get their own columns. ``float('nan')`` (not measured, e.g. GPU memory in a dry run) is written as null.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["OPTIONAL_PACKAGES", "add_arguments", "check", "missing_optional_package", "table", "write"]

# Packages a bare GPU machine may lack (import names): what fails only for want of one of them is skipped.
OPTIONAL_PACKAGES = (
    "datasets", "wandb", "jsonargparse", "flash_attn", "bitsandbytes", "llvmlite", "pyarrow", "trl", "matplotlib",
    "vllm",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--json`` and ``--dry-run``, the two options ``check.py`` passes to every part."""
    parser.add_argument("--json", type=Path, default=None, help="also write the results to this JSON file")
    parser.add_argument(
        "--dry-run", action="store_true", help="tiny shapes on the CPU: checks that the script runs, measures nothing"
    )


def table(title: str, columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> dict[str, Any]:
    rows = [list(row) for row in rows]
    if any(len(row) != len(columns) for row in rows):
        raise ValueError(f"Table {title!r}: every row needs {len(columns)} values ({', '.join(columns)}).")
    return {"title": title, "columns": list(columns), "rows": rows}


def check(name: str, passed: bool, detail: str) -> dict[str, Any]:
    return {"name": name, "passed": bool(passed), "detail": detail}


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else str(value)
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


def write(
    path: Path | None,
    *,
    summary: str,
    tables: Sequence[dict[str, Any]],
    checks: Sequence[dict[str, Any]] = (),
    config: dict[str, Any] | None = None,
) -> bool:
    """Write the part's results to ``path`` (nothing when ``None``) and return whether every check passed."""
    result = {"summary": summary, "tables": list(tables), "checks": list(checks), "config": config or {}}
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(_finite(result), indent=1, allow_nan=False) + "\n")
    return all(item["passed"] for item in checks)


def missing_optional_package(output: str) -> str | None:
    """The package of :data:`OPTIONAL_PACKAGES` whose import failed in ``output`` (a traceback), if any."""
    for name in re.findall(r"No module named '([\w.]+)'", output):
        if name.split(".")[0] in OPTIONAL_PACKAGES:
            return name.split(".")[0]
    return None
