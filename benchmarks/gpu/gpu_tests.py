"""GPU check part: the GPU-marked tests (``pytest -m gpu``), one row per test.

Only the test files that mention ``mark.gpu`` are collected: the others hold no GPU test and some import
packages a bare GPU machine lacks (``datasets``). A test that fails, or a file that cannot be collected,
only because a package of ``results.OPTIONAL_PACKAGES`` is missing counts as skipped, with the package
named; every other failure or error fails the part. Without CUDA (``--dry-run``) the same tests are
collected and skip themselves.

Run from the repository root::

    PYTHONPATH=. python benchmarks/gpu/gpu_tests.py --json gpu-check/parts/gpu_tests.json
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest

from results import add_arguments, check, missing_optional_package, table, write

ROOT = Path(__file__).resolve().parents[2]


def gpu_test_files() -> list[Path]:
    return sorted(path for path in (ROOT / "tests").rglob("test_*.py") if "mark.gpu" in path.read_text())


def _outcome(case: ElementTree.Element) -> tuple[str, str]:
    """(outcome, message) of one junit ``testcase``."""
    for tag in ("failure", "error"):
        problem = case.find(tag)
        if problem is not None:
            text = f"{problem.get('message', '')}\n{problem.text or ''}"
            package = missing_optional_package(text)
            if package is not None:
                return "skipped", f"needs {package}, which is not installed"
            return ("failed" if tag == "failure" else "error"), problem.get("message", "").splitlines()[0][:200]
    skipped = case.find("skipped")
    if skipped is not None:
        return "skipped", skipped.get("message", "")[:200]
    return "passed", ""


def read_junit(path: Path) -> list[list[object]]:
    """One ``[test, outcome, seconds, message]`` row per test case (or per file that failed to collect)."""
    rows = []
    for case in ElementTree.parse(path).iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}" if case.get("classname") else case.get("name")
        outcome, message = _outcome(case)
        rows.append([name, outcome, round(float(case.get("time", 0.0)), 2), message])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args()
    files = [str(path.relative_to(ROOT)) for path in gpu_test_files()]
    print(f"GPU-marked tests in {len(files)} files: {', '.join(files)}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        code = pytest.main(
            ["-m", "gpu", "-rA", "-p", "no:cacheprovider", "--continue-on-collection-errors",
             f"--rootdir={ROOT}", f"--junitxml={junit}", *[str(ROOT / f) for f in files]]
        )
        rows = read_junit(junit) if junit.exists() else []
    counts = {outcome: sum(row[1] == outcome for row in rows) for outcome in ("passed", "failed", "error", "skipped")}
    lacking = sum(row[1] == "skipped" and str(row[3]).endswith("is not installed") for row in rows)
    summary = ", ".join(f"{count} {outcome}" for outcome, count in counts.items() if count) or "no tests ran"
    if lacking:
        summary += f" ({lacking} for want of a package)"
    checks = [
        check("GPU-marked tests were found and collected", bool(rows), f"{len(rows)} in {len(files)} files"),
        check("no GPU test failed", counts["failed"] + counts["error"] == 0, summary),
        check("pytest ran to its end", int(code) in (0, 1), f"pytest exit status {int(code)}"),
    ]
    passed = write(
        args.json, summary=summary, tables=[table("GPU-marked tests", ["test", "outcome", "s", "message"], rows)],
        checks=checks, config={"files": files},
    )
    sys.exit(0 if passed else 1)


if __name__ == "__main__":
    main()
