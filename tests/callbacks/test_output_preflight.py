"""A fit checks its outputs before the first step (folders writable, room for a checkpoint and an export), and an
export that fails at the end keeps the trained weights, says where, and leaves no folder that looks complete."""

from __future__ import annotations

import errno
import shutil
from collections import namedtuple
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, PreTrainedModel

from lit_memtrain.cli import main

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = str(ROOT / "configs" / "quickstart.yaml")
TINY = "--model.config_overrides={hidden_size: 32, intermediate_size: 64, num_hidden_layers: 1, head_dim: 16}"


@pytest.fixture
def fit(tmp_path, monkeypatch):
    """The quickstart made tiny (two steps, no W&B), run in ``tmp_path``."""
    monkeypatch.chdir(tmp_path)
    return [
        "fit", "--config", QUICKSTART, "--trainer.logger=false", f"--trainer.default_root_dir={tmp_path}",
        "--trainer.max_steps=2", "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false", TINY,
        "--data.batch_size=2", "--data.val_size=0",
    ]  # fmt: skip


def refusal(args: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    out = capsys.readouterr()
    assert exit_info.value.code == 2 and "train loss" not in out.out  # refused before the first step
    return out.err.strip().splitlines()[-1]


def test_an_export_folder_that_cannot_be_written_refuses_before_the_first_step(fit, tmp_path, capsys):
    (tmp_path / "a-file").touch()  # root writes anywhere: a file in the way is what no user can write through
    export = tmp_path / "a-file" / "export"
    assert refusal([*fit, f"--model.export_dir={export}"], capsys) == (
        f"lit-memtrain fit: error: {export.parent} cannot be written (it is a file, not a folder); the fit would fail "
        "when it writes there."
    )


def test_a_filesystem_without_room_for_a_checkpoint_and_the_export_refuses_with_the_figures(
    fit, tmp_path, capsys, monkeypatch
):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(2**30, 2**30 - 2**16, 2**16))
    line = refusal([*fit, "--trainer.enable_checkpointing=true", f"--model.export_dir={tmp_path / 'export'}"], capsys)
    # 28,768 fp32 parameters: a checkpoint 115,072 bytes + AdamW's 230,144, an export 115,072
    assert line == (
        f"lit-memtrain fit: error: Not enough room: {tmp_path / 'checkpoints'} (0.3 MiB), {tmp_path} (0.1 MiB) need "
        "about 0.4 MiB on one filesystem and 0.1 MiB are free. Free some space or write the outputs elsewhere."
    )


def test_an_export_failing_at_the_end_keeps_the_trained_weights_and_leaves_no_folder_looking_complete(
    fit, tmp_path, monkeypatch
):
    export = tmp_path / "export"
    save_pretrained = PreTrainedModel.save_pretrained

    def disk_fills(self, directory, *args, **kwargs):
        Path(directory).mkdir(parents=True, exist_ok=True)
        (Path(directory) / "config.json").write_text("{}")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", disk_fills)
    with pytest.raises(OSError, match=r"The export to .* failed .*No space left") as raised:
        main([*fit, f"--model.export_dir={export}"])  # checkpointing off, as in the quickstart
    saved = tmp_path / "trained-step=2.ckpt"
    assert str(raised.value).endswith(
        f"the trained weights are saved in {saved}: lit-memtrain export --checkpoint {saved} --output <folder> writes "
        "the export from them"
    )
    # no export folder, and no partial one
    assert sorted(path.name for path in tmp_path.iterdir()) == ["config.yaml", "trained-step=2.ckpt"]
    monkeypatch.setattr(PreTrainedModel, "save_pretrained", save_pretrained)
    main(["export", "--checkpoint", str(saved), "--output", str(export)])
    assert AutoModelForCausalLM.from_pretrained(export).config.num_hidden_layers == 1
