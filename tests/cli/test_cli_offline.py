"""Offline use of the command line: a hub id that cannot be had ends in one line at once (not after a minute of
retries), naming the offline forms and the ``hf`` command; a module in the working directory imports from a config."""

from __future__ import annotations

import socket
import sys
import time
from pathlib import Path

import pytest
from huggingface_hub import constants

from lit_memtrain.cli import main
from lit_memtrain.datamodules.hub_access import require_hub

ROOT = Path(__file__).resolve().parents[2]
LORA = str(ROOT / "configs" / "lora.yaml")
GRPO = str(ROOT / "configs" / "grpo.yaml")
PROXIES = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")


def _error_line(args: list[str], capsys) -> tuple[str, float]:
    start = time.perf_counter()
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    seconds = time.perf_counter() - start
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err and "Retrying" not in err, err
    return err.strip().splitlines()[-1], seconds


def test_hf_hub_offline_ends_a_hub_recipe_in_one_line_naming_the_offline_forms(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    line, _ = _error_line(["fit", "--config", LORA, "--trainer.logger=false"], capsys)
    assert line.startswith(
        "lit-memtrain fit: error: HF_HUB_OFFLINE=1 and tokenizer 'Qwen/Qwen3-0.6B' is not in the Hugging Face cache"
    )
    assert "--model.model=/path/to/dir" in line and "smollm2-135m-instruct" in line
    assert "hf download Qwen/Qwen3-0.6B" in line and "huggingface-cli" not in line


def test_an_unreachable_hub_ends_in_one_line_at_once(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    for variable in PROXIES:
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # the discard port: nothing listens
    line, seconds = _error_line(["fit", "--config", LORA, "--trainer.logger=false"], capsys)
    assert line.startswith(
        "lit-memtrain fit: error: tokenizer 'Qwen/Qwen3-0.6B' is a Hugging Face hub id, and the hub 127.0.0.1:9 "
        "cannot be reached ("
    )
    assert "hf download Qwen/Qwen3-0.6B) and set HF_HUB_OFFLINE=1" in line and "--model.model=/path/to/dir" in line
    assert seconds < 30  # transformers' own retries take about 50 s; parsing and the data take a few


@pytest.mark.parametrize("variable", ["HTTPS_PROXY", "all_proxy"])
def test_behind_a_proxy_the_hub_is_not_probed(monkeypatch, variable):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv(variable, "http://proxy.example:3128")

    def no_direct_connection(*args, **kwargs):
        raise AssertionError("a direct connection says nothing about the proxy's route to the hub")

    monkeypatch.setattr(socket, "create_connection", no_direct_connection)
    require_hub("Qwen/Qwen3-0.6B", "model")  # the download itself answers, through the proxy


def test_a_local_path_is_not_a_hub_id(tmp_path, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    require_hub(str(tmp_path), "model")


def test_a_reward_function_module_in_the_working_directory_imports(tmp_path, monkeypatch, capsys):
    """``reward_funcs: [my_rewards.length]`` from the ``lit-memtrain`` command, whose ``sys.path`` starts with its own
    folder, not the working directory: the fit gets past building the module to the (missing) dataset."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [entry for entry in sys.path if entry not in ("", str(tmp_path))])
    (tmp_path / "my_rewards.py").write_text(
        "def length(prompts, completions, **kwargs):\n    return [float(len(c)) for c in completions]\n"
    )
    line, _ = _error_line(
        ["fit", "--config", GRPO, "--trainer.logger=false", "--model.reward_funcs=[my_rewards.length]",
         "--model.reward_weights=null", "--data.dataset=missing.jsonl"],
        capsys,
    )  # fmt: skip
    assert "my_rewards" not in line and "missing.jsonl" in line
