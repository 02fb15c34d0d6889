"""Relaunching a preempted ``lit-memtrain fit --ckpt_path last`` resumes where it stopped: with the shipped W&B
logger (offline) the run continues under its id, an unreadable checkpoint is skipped for the newest readable one,
a folder a live run holds is refused, and a checkpoint of another configuration is refused."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import wandb
import yaml
from lightning.pytorch import LightningDataModule
from lightning.pytorch.callbacks import ModelCheckpoint

from lit_memtrain.callbacks.run_folder_lock import RunFolderLock
from lit_memtrain.cli import MemTrainCLI, main, names_model_class
from lit_memtrain.cli.resume import resume_point, stable_checkpoint_folders
from lit_memtrain.datamodules.sft import SFTDataModule
from lit_memtrain.objectives.causal_lm import CausalLMModule

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = str(ROOT / "configs" / "quickstart.yaml")
TINY = "--model.config_overrides={hidden_size: 32, intermediate_size: 64, num_hidden_layers: 1, head_dim: 16}"
EVERY_STEP = (
    "--trainer.callbacks+={class_path: lightning.pytorch.callbacks.ModelCheckpoint, "
    "init_args: {every_n_train_steps: 1, save_last: true, save_top_k: -1}}"
)


def fit(folder: Path, *extra: str) -> None:
    """The quickstart (W&B offline logger) made tiny, checkpointing every step into ``folder``, resuming ``last``."""
    try:
        main([
            "fit", "--config", QUICKSTART, "--ckpt_path", "last", "--trainer.enable_checkpointing=true", EVERY_STEP,
            "--trainer.max_steps=2", "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false",
            f"--trainer.logger.init_args.save_dir={folder}", TINY, "--model.export_dir=null",
            "--data.batch_size=2", "--data.val_size=0", *extra,
        ])  # fmt: skip
    finally:
        wandb.finish()  # a run still open would be taken up by the next fit's logger


def plain_fit(folder: Path, *extra: str) -> list[str]:
    """The arguments of :func:`fit` without W&B: checkpoints in ``folder/checkpoints``."""
    return [
        "fit", "--config", QUICKSTART, "--ckpt_path", "last", "--trainer.enable_checkpointing=true", EVERY_STEP,
        "--trainer.logger=false", f"--trainer.default_root_dir={folder}", "--trainer.limit_val_batches=0",
        "--trainer.enable_progress_bar=false", TINY, "--model.export_dir=null", "--data.batch_size=2",
        "--data.val_size=0", *extra,
    ]  # fmt: skip


# A fit that SIGKILLs itself half way through writing its step-3 checkpoint: a preemption during a save.
KILLED_DURING_A_SAVE = """
import io, os, signal, sys
import torch
from lit_memtrain.cli import main

save = torch.save


def save_then_die_at_step_3(checkpoint, file, *args, **kwargs):
    if isinstance(checkpoint, dict) and checkpoint.get("global_step") == 3:
        buffer = io.BytesIO()
        save(checkpoint, buffer)
        file.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
        file.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    return save(checkpoint, file, *args, **kwargs)


torch.save = save_then_die_at_step_3
main(sys.argv[1:])
"""


def error_line(capsys) -> str:
    """The one line a refused fit printed (W&B prints its own lines after it)."""
    return next(line for line in capsys.readouterr().err.splitlines() if line.startswith("lit-memtrain fit: error: "))


def step_of(path: Path) -> int:
    return int(torch.load(path, weights_only=True)["global_step"])


def run_ids(folder: Path) -> list[str]:
    """The id of each W&B run the folder holds, as its data file names it (the folder of a run resumed in the same
    second as the first is named ``offline-run-<time>-<id>-1``)."""
    return sorted(path.stem.removeprefix("run-") for path in (folder / "wandb").glob("offline-run-*/run-*.wandb"))


FIT_CONFIGS = sorted(path.name for path in (ROOT / "configs").glob("*.yaml") if path.name != "sweep.yaml")


@pytest.mark.parametrize("name", FIT_CONFIGS)
def test_every_shipped_config_checkpoints_into_one_folder_whatever_its_logger_run(name, tmp_path, monkeypatch):
    """With checkpointing on, each config's checkpoints go where the next launch looks: its ModelCheckpoint's
    dirpath, else <the logger's save_dir>/checkpoints (before: <save_dir>/<project>/<W&B run id>/checkpoints)."""
    monkeypatch.chdir(tmp_path)
    config = yaml.safe_load((ROOT / "configs" / name).read_text())
    by_class = names_model_class(["--config", str(ROOT / "configs" / name)])
    model, data = ("--model.init_args.", "--data.init_args.") if by_class else ("--model.", "--data.")
    args = [
        "--config", str(ROOT / "configs" / name), "--trainer.enable_checkpointing=true", "--trainer.accelerator=cpu",
        "--trainer.devices=1", "--trainer.strategy=auto", f"{model}model=null", f"{model}preset=tiny-qwen3",
        f"{model}attn_implementation=sdpa", f"{data}tokenizer=lit-memtrain/embedded",
        *([f"{model}generation_backend=transformers", f"{model}generation_options=null"] if "grpo" in name else []),
    ]  # fmt: skip: an offline model, and no flash-attn or vLLM, which the configs' classes check for
    cli = MemTrainCLI(
        CausalLMModule, LightningDataModule if by_class else SFTDataModule, subclass_mode_model=by_class,
        subclass_mode_data=by_class, args=args, run=False,
    )  # fmt: skip
    trainer = config["trainer"]
    dirpaths = [c["init_args"]["dirpath"] for c in trainer.get("callbacks", []) if "dirpath" in c.get("init_args", {})]
    save_dir = (trainer.get("logger") or {}).get("init_args", {}).get("save_dir", ".")
    expected = dirpaths or [os.path.join(save_dir, "checkpoints")]
    assert stable_checkpoint_folders(cli.trainer) == [os.path.realpath(path) for path in expected]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, Path]:
    """A run folder after a two-step fit (checkpoints at steps 1 and 2, and last.ckpt), and a copy of it."""
    folder = tmp_path_factory.mktemp("trained") / "run"
    fit(folder)
    return folder, Path(shutil.copytree(folder, folder.with_name("pristine")))


@pytest.fixture
def run(trained) -> Path:
    """The trained run folder as the two-step fit left it, for a test to resume or damage (in its own place:
    ModelCheckpoint keeps using last.ckpt only in the folder that wrote it)."""
    folder, pristine = trained
    shutil.rmtree(folder)
    return Path(shutil.copytree(pristine, folder))


def test_the_first_fit_says_it_starts_fresh_and_where_it_looked(tmp_path, info_lines):
    folder = tmp_path / "fresh"
    fit(folder, "--trainer.max_steps=1")
    assert f"Starting fresh: no checkpoint to resume in {folder / 'checkpoints'}" in info_lines
    assert sorted(path.name for path in (folder / "checkpoints").glob("*.ckpt")) == ["epoch=0-step=1.ckpt", "last.ckpt"]


def test_relaunching_resumes_the_newest_readable_checkpoint_and_continues_the_wandb_run(run, info_lines, recwarn):
    checkpoints = run / "checkpoints"
    assert sorted(path.name for path in checkpoints.glob("*.ckpt")) == [
        "epoch=0-step=1.ckpt", "epoch=0-step=2.ckpt", "last.ckpt",
    ]  # fmt: skip
    (checkpoints / "last.ckpt").write_bytes((checkpoints / "last.ckpt").read_bytes()[:1000])  # a kill mid-copy
    (checkpoints / f".last.ckpt.partial-{2**22 + 1}").write_bytes(b"half")  # what a kill during a save leaves
    first_id = run_ids(run)
    fit(run, "--trainer.max_steps=3")
    skipped = [str(w.message) for w in recwarn if "Skipped checkpoint" in str(w.message)]
    reason = "truncated or not a checkpoint (no complete zip archive)"
    assert skipped == [f"Skipped checkpoint {checkpoints / 'last.ckpt'}: {reason}"]
    assert f"Resuming from {checkpoints / 'epoch=0-step=2.ckpt'} (step 2)" in info_lines
    assert step_of(checkpoints / "last.ckpt") == step_of(checkpoints / "epoch=0-step=3.ckpt") == 3
    assert len(first_id) == 1 and run_ids(run) == first_id * 2  # one W&B run, continued under its id
    assert not list(checkpoints.glob(".*.partial-*"))  # the orphan was removed at start


def test_a_users_own_logger_resumes_from_the_same_folder_and_keeps_its_earlier_logs(tmp_path, info_lines):
    csv = "--trainer.logger={class_path: lightning.pytorch.loggers.CSVLogger, init_args: {save_dir: %s}}" % tmp_path
    fit(tmp_path, csv, "--trainer.max_steps=1", "--trainer.log_every_n_steps=1")
    fit(tmp_path, csv, "--trainer.max_steps=2", "--trainer.log_every_n_steps=1")
    assert f"Resuming from {tmp_path / 'checkpoints' / 'last.ckpt'} (step 1)" in info_lines
    assert step_of(tmp_path / "checkpoints" / "last.ckpt") == 2
    logs = sorted(path.parent.name for path in (tmp_path / "lightning_logs").glob("*/metrics.csv"))
    assert logs == ["version_0", "version_1"]  # a CSVLogger given version_0 again would delete its metrics


def test_a_second_fit_on_a_folder_a_live_run_holds_refuses_naming_it(run, capsys, info_lines):
    checkpoints = run / "checkpoints"
    held = run / "held"
    pid = os.fork()
    if pid == 0:  # another fit, holding the folder
        try:
            stub = SimpleNamespace(
                is_global_zero=True, checkpoint_callbacks=[ModelCheckpoint(dirpath=checkpoints)],
                strategy=SimpleNamespace(broadcast=lambda value, src=0: value),
            )  # fmt: skip
            lock = RunFolderLock()
            lock.on_fit_start(stub, None)
            held.touch()
            time.sleep(60)
            lock.release()
        finally:
            os._exit(0)
    try:
        deadline = time.monotonic() + 30
        while not held.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(SystemExit) as exit_info:
            fit(run, "--trainer.max_steps=3")
        assert exit_info.value.code == 2
        line = error_line(capsys)
        assert line.startswith(
            f"lit-memtrain fit: error: {checkpoints} is held by a run that is still going (process {pid} on "
        )
        assert step_of(checkpoints / "last.ckpt") == 2 and len(run_ids(run)) == 1  # nothing written, no W&B run
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    fit(run, "--trainer.max_steps=3")  # the killed run's hold is stale: taken over
    took_over = f"{checkpoints}: took over the hold of a run that ended without releasing it (process {pid} "
    assert any(line.startswith(took_over) for line in info_lines)
    assert step_of(checkpoints / "last.ckpt") == 3


@pytest.mark.parametrize(
    ("other", "difference"),
    [
        (
            "--model.config_overrides={hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, head_dim: 16}",
            "model configuration (config_overrides: {'hidden_size': 32, 'intermediate_size': 64, 'num_hidden_layers': "
            "1, 'head_dim': 16} there, {'hidden_size': 32, 'intermediate_size': 64, 'num_hidden_layers': 2, "
            "'head_dim': 16} now); resume it with the same model settings",
        ),
        ("--data.max_length=32", "data configuration (max_length: 64 there, 32 now); resume it with the same data"),
    ],
    ids=["model", "data"],
)
def test_resuming_a_checkpoint_of_another_configuration_refuses_in_one_line(run, capsys, other, difference):
    with pytest.raises(SystemExit) as exit_info:
        fit(run, "--trainer.max_steps=3", other)
    assert exit_info.value.code == 2
    assert error_line(capsys).startswith(
        f"lit-memtrain fit: error: {run / 'checkpoints' / 'last.ckpt'} was made with another {difference}"
    )
    assert step_of(run / "checkpoints" / "last.ckpt") == 2


def test_an_unreadable_checkpoint_given_to_fit_is_named_in_one_line(run, capsys):
    broken = run / "checkpoints" / "epoch=0-step=2.ckpt"
    broken.write_bytes(broken.read_bytes()[:500])
    with pytest.raises(SystemExit):
        main(["fit", "--config", QUICKSTART, "--trainer.logger=false", f"--ckpt_path={broken}", TINY])
    line = error_line(capsys)
    assert line == (
        f"lit-memtrain fit: error: --ckpt_path {broken} cannot be read: truncated or not a checkpoint (no complete "
        "zip archive). Give another checkpoint, or --ckpt_path last for the newest readable one."
    )


def test_a_fit_killed_during_a_save_resumes_from_its_last_complete_checkpoint(tmp_path, preloaded_python, info_lines):
    killed = preloaded_python.run("-c", KILLED_DURING_A_SAVE, *plain_fit(tmp_path, "--trainer.max_steps=4"))
    assert killed.returncode != 0 and "train loss" not in killed.stdout
    checkpoints = tmp_path / "checkpoints"
    assert sorted(path.name for path in checkpoints.glob("*.ckpt")) == [
        "epoch=0-step=1.ckpt", "epoch=0-step=2.ckpt", "last.ckpt",
    ]  # fmt: skip
    (orphan,) = checkpoints.glob(".epoch=0-step=3.ckpt.partial-*")
    main(plain_fit(tmp_path, "--trainer.max_steps=4"))
    resumed = {f"Resuming from {checkpoints / name} (step 2)" for name in ("last.ckpt", "epoch=0-step=2.ckpt")}
    assert resumed & set(info_lines)
    assert step_of(checkpoints / "last.ckpt") == 4 and not orphan.exists()


def _cross_device_at_step_3(monkeypatch) -> None:
    """Renames into the step-3 checkpoint fail as a rename into another filesystem does."""
    replace = os.replace

    def cross_device(source, destination):
        if str(destination).endswith("step=3.ckpt"):
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        return replace(source, destination)

    monkeypatch.setattr(os, "replace", cross_device)


def _disk_full_at_step_3(monkeypatch) -> None:
    """The disk fills half way through writing the step-3 checkpoint."""
    save = torch.save

    def disk_fills(checkpoint, file, *args, **kwargs):
        if isinstance(checkpoint, dict) and checkpoint.get("global_step") == 3:
            file.write(b"PK\x03\x04 half a checkpoint")
            raise OSError(errno.ENOSPC, "No space left on device")
        return save(checkpoint, file, *args, **kwargs)

    monkeypatch.setattr(torch, "save", disk_fills)


@pytest.mark.parametrize(
    ("fault", "reason"),
    [(_cross_device_at_step_3, "Invalid cross-device link"), (_disk_full_at_step_3, "the disk is full")],
    ids=["rename-across-filesystems", "disk-full"],
)
def test_a_save_that_fails_stops_the_fit_naming_it_and_loses_nothing(tmp_path, monkeypatch, info_lines, fault, reason):
    checkpoints = tmp_path / "checkpoints"
    step_3 = checkpoints / "epoch=0-step=3.ckpt"
    fault(monkeypatch)
    with pytest.raises(OSError, match=rf"Could not write {step_3} \({reason}\); the file under that name, if any, is"):
        main(plain_fit(tmp_path, "--trainer.max_steps=4"))
    monkeypatch.undo()
    assert sorted(path.name for path in checkpoints.iterdir() if path.suffix == ".ckpt" or "partial" in path.name) == [
        "epoch=0-step=1.ckpt", "epoch=0-step=2.ckpt", "last.ckpt",
    ]  # fmt: skip
    assert step_of(checkpoints / "last.ckpt") == 2
    main(plain_fit(tmp_path, "--trainer.max_steps=4"))
    assert f"Resuming from {checkpoints / 'last.ckpt'} (step 2)" in info_lines
    assert step_of(checkpoints / "last.ckpt") == 4


def test_a_remote_checkpoint_folder_is_left_to_lightnings_own_resolution():
    point = resume_point("last", ["s3://bucket/run/checkpoints"])
    assert (point.path, point.checkpoint) == ("last", None)
    assert point.lines == ["Resuming from last as Lightning finds it in s3://bucket/run/checkpoints"]


def test_a_fresh_fit_in_a_folder_of_an_earlier_run_resumes_its_own_checkpoints_not_the_earlier_runs(run, info_lines):
    checkpoints = run / "checkpoints"
    fit(run, "--ckpt_path=null", "--trainer.max_steps=1")  # starts over beside the earlier run's steps 1 and 2
    assert f"Starting fresh (no --ckpt_path); checkpoints go to {checkpoints}, which --ckpt_path last resumes" in (
        info_lines
    )
    own = {checkpoints / "last-v1.ckpt", checkpoints / "epoch=0-step=1-v1.ckpt"}
    assert own <= set(checkpoints.glob("*.ckpt"))
    fit(run, "--trainer.max_steps=2")
    assert {f"Resuming from {path} (step 1)" for path in own} & set(info_lines)  # not the earlier run's step 2


def grpo_fit(folder: Path, max_steps: int) -> dict:
    """The GRPO config (sampled completions, seed_everything: 0) made tiny, checkpointing every step into
    ``folder``, resuming ``last``, at a constant learning rate; its last checkpoint's weights."""
    main([
        "fit", "--config", str(ROOT / "configs" / "grpo.yaml"), "--ckpt_path", "last",
        "--trainer.enable_checkpointing=true", EVERY_STEP, "--trainer.logger=false",
        f"--trainer.default_root_dir={folder}", "--trainer.enable_progress_bar=false",
        f"--trainer.max_steps={max_steps}",
        "--model.init_args.config_overrides={hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, "
        "head_dim: 16}", "--model.init_args.export_dir=null", "--model.init_args.num_generations=2",
        "--model.init_args.min_lr_ratio=1.0", "--data.init_args.batch_size=2",
    ])  # fmt: skip
    return torch.load(folder / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]


def test_a_relaunched_sampling_fit_samples_and_trains_as_the_uninterrupted_one(tmp_path, info_lines):
    """Lightning keeps no random generator state and the relaunch seeds them as at step 1: the resumed steps sampled
    the completions of steps 1-2 again (weights 4e-3 away at step 4). The checkpoint keeps them."""
    straight = grpo_fit(tmp_path / "straight", 4)
    grpo_fit(tmp_path / "relaunched", 2)
    resumed = grpo_fit(tmp_path / "relaunched", 4)
    assert f"Resuming from {tmp_path / 'relaunched' / 'checkpoints' / 'last.ckpt'} (step 2)" in info_lines
    for name, expected in straight.items():
        torch.testing.assert_close(resumed[name], expected, rtol=0, atol=0, msg=name)
