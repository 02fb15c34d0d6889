"""``benchmarks/docs_check.py``: the docs' command blocks run as written and print the figures the docs show.

The fast blocks of README.md and docs/*.md run here (those not marked ``slow``: ``make docs-check`` runs all); the
checker itself is tested on small documents: a moved figure fails, a marked block is skipped with its reason."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("docs_check", ROOT / "benchmarks" / "docs_check.py")
docs_check = sys.modules.setdefault("docs_check", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(docs_check)

DOC = """# A doc

```bash
echo "Peak device memory per rank: 54.30 GiB, in backward"   # 54.30 GiB
```

<!-- docs-check: output -->
```
Peak device memory per rank: {figure} GiB, in backward
```

<!-- docs-check: needs gpu: a CUDA GPU; on a CPU, --dry-run -->
```bash
nvidia-smi --this-would-fail
```

```text
$ echo "exact answers: 3/200" && false
exact answers: 3/200
```
"""


def _check(tmp_path: Path, figure: str, capsys) -> tuple[int, str]:
    doc = tmp_path / "doc.md"
    doc.write_text(DOC.format(figure=figure))
    status = docs_check.main([str(doc)])
    return status, capsys.readouterr().out


def test_a_doc_whose_figures_the_commands_print_passes(tmp_path, capsys):
    status, out = _check(tmp_path, "54.30", capsys)
    assert status == 0, out
    assert "SKIP" in out and "(needs gpu: a CUDA GPU; on a CPU, --dry-run)" in out
    assert "docs-check: 2 of 2 blocks passed" in out


def test_a_figure_that_moved_fails_until_the_doc_is_updated(tmp_path, capsys):
    status, out = _check(tmp_path, "54.90", capsys)  # 1.1% off: over the 1% tolerance
    assert status == 1
    assert "other figures: the doc shows  Peak device memory per rank: 54.90 GiB, in backward" in out
    assert "the command printed Peak device memory per rank: 54.30 GiB, in backward" in out
    status, out = _check(tmp_path, "54.70", capsys)  # 0.7% off: within it
    assert status == 0, out


def test_a_comment_figure_the_command_does_not_print_fails(tmp_path, capsys):
    doc = tmp_path / "doc.md"
    doc.write_text('```bash\necho "peak 41.00 GiB"   # 51.71 GiB, in generation\n```\n')
    assert docs_check.main([str(doc)]) == 1
    assert "the comment's figure '51.71 GiB' is not printed" in capsys.readouterr().out


def test_the_fast_blocks_of_the_readme_and_docs_run_as_written(capsys):
    status = docs_check.main(["--fast"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "PASS README.md" in out and "PASS docs/planner.md" in out
    assert "FAIL" not in out


@pytest.mark.parametrize("needs", docs_check.NEEDS)
def test_every_skipped_block_says_why(needs):
    for path in docs_check.documents([]):
        for block in docs_check.blocks_of(path):
            if block.needs and block.needs.startswith(f"needs {needs}"):
                assert len(block.needs) > len(f"needs {needs}: ") + 20, f"{block.name}: say why, and what runs instead"
