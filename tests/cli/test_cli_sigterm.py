"""SIGTERM stops ``lit-memtrain fit`` cleanly: a real process, a real signal; the fit saves a checkpoint that
``--ckpt_path last`` resumes, says so in one line and exits with status 143 soon after."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = str(ROOT / "configs" / "quickstart.yaml")
SMALL = "--model.config_overrides={hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, head_dim: 8}"
STARTED = """
from pathlib import Path
from lightning.pytorch import Callback

class Started(Callback):
    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == 2:
            Path("started").touch()
"""


def _wait_for(path: Path, process: subprocess.Popen, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, f"{path} did not appear in {seconds} s"
        time.sleep(0.2)


def test_sigterm_saves_a_checkpoint_and_exits_with_143(tmp_path):
    (tmp_path / "started_marker.py").write_text(STARTED)
    command = [
        sys.executable, "-m", "lit_memtrain.cli", "fit", "--config", QUICKSTART, SMALL, "--data.max_length=64",
        "--trainer.max_steps=100000", "--trainer.logger=false", "--trainer.enable_checkpointing=true",
        "--trainer.enable_progress_bar=false", f"--trainer.default_root_dir={tmp_path}",
        "--trainer.callbacks+=started_marker.Started",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(
        command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        _wait_for(tmp_path / "started", process, seconds=120)
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 128 + signal.SIGTERM, output
    saved = list((tmp_path / "checkpoints").glob("sigterm-step=*.ckpt"))
    assert len(saved) == 1, output
    step = torch.load(saved[0], map_location="cpu", weights_only=False)["global_step"]
    assert 2 <= step < 100000 and saved[0].name == f"sigterm-step={step}.ckpt"
    assert f"SIGTERM: the fit stopped after step {step}; saved {saved[0]} (--ckpt_path last resumes it)" in output
    assert "Traceback" not in output
