"""A preset plans with its own vocabulary (issue 22, point 6), and the plan's model line says which.

Before, a preset took the tokenizer's vocabulary: `preset: qwen3-4b` with the embedded tokenizer planned an LM head
of 384 rows, so the plain loss planned like the chunked one. All plans run in one child process of
``preloaded_python`` (the stand-in device must be registered before a process's first backward); one decoder layer
keeps them fast.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

TOKENS, QWEN3_VOCABULARY, FP32 = 8192, 151_936, 4
# `config_overrides` replaced: the config's own `vocab_size: 151936` (a workaround for the bug) is gone.
QWEN3_4B = ["--config", "configs/plan_qwen3_4b.yaml", "--model.config_overrides={num_hidden_layers: 1}",
            f"--data.max_length={TOKENS}", "--gpu-memory=80"]  # fmt: skip

_PLANS = """
import contextlib, io, json, sys
from lit_memtrain.cli.plan import read_fit_config
from lit_memtrain.planner.command import main
results = []
for args in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(args, read_fit_config)
    results.append([status, out.getvalue(), err.getvalue()])
print(json.dumps(results))
"""


def _plans(preloaded_python, *plans: list[str]) -> list[tuple[int, str, str]]:
    result = preloaded_python.run("-c", _PLANS, json.dumps(plans))
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def _large_tokenizer(directory: Path) -> Path:
    """The embedded tokenizer grown to 600 tokens: more than tiny-qwen3's vocabulary of 512."""
    from lit_memtrain.datamodules.tokenizer import load_tokenizer

    tokenizer = load_tokenizer("lit-memtrain/embedded")
    tokenizer.add_tokens([f"<extra_{index}>" for index in range(600 - len(tokenizer))])
    tokenizer.save_pretrained(directory)
    return directory


def test_a_preset_plans_its_own_vocabulary_and_the_plain_loss_pays_for_the_logits(preloaded_python, tmp_path: Path):
    (chunked_status, chunked, _), (plain_status, plain, _), (refused_status, _, refused) = _plans(
        preloaded_python,
        [*QWEN3_4B, "--json"],
        [*QWEN3_4B, "--model.loss_type=nll"],
        ["--config", "configs/quickstart.yaml", f"--data.tokenizer={_large_tokenizer(tmp_path / 'tokenizer')}"],
    )
    assert (chunked_status, plain_status) == (0, 0)
    chunked_plan = json.loads(chunked)
    assert chunked_plan["vocab_size"] == QWEN3_VOCABULARY and chunked_plan["model"] == "preset qwen3-4b"
    assert f"1 decoder layers, vocabulary {QWEN3_VOCABULARY:,}\n" in plain
    plain_peak = float(re.search(r"Peak device memory per rank: ([\d,.]+) GiB", plain).group(1).replace(",", ""))
    logits = TOKENS * QWEN3_VOCABULARY * FP32
    assert plain_peak * 2**30 - chunked_plan["peak_device_bytes"] >= logits
    assert refused_status == 2
    assert (
        "lit-memtrain plan: error: The tokenizer has 600 tokens but the model's embedding has only 512 rows "
        "(the vocabulary of preset 'tiny-qwen3')" in refused
    )
    assert "config_overrides.vocab_size to at least 600" in refused
