"""``lit-memtrain curves``: the points drawn are the ones a real CSVLogger run logged, and a wrong key is named."""

import os

import matplotlib.image
import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from lit_memtrain.cli import main
from lit_memtrain.cli.curves import newest_metrics_file, read_curves


class LogsKnownValues(LightningModule):
    """Logs ``train/value`` = 10 * step + 1 at each training step and ``val/value`` = 100 + step at each validation,
    and records (step, value) as it logs them."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.logged: dict[str, list[tuple[int, float]]] = {"train/value": [], "val/value": []}

    def training_step(self, batch, batch_idx):
        value = 10.0 * self.global_step + 1
        self.log("train/value", value)
        self.logged["train/value"].append((self.global_step, value))
        return self.layer(batch).sum()

    def validation_step(self, batch, batch_idx):
        value = 100.0 + self.global_step
        self.log("val/value", value)
        self.logged["val/value"].append((self.global_step, value))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(torch.ones(6, 1), batch_size=1)

    def val_dataloader(self):
        return DataLoader(torch.ones(1, 1), batch_size=1)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A real CSVLogger run: 6 steps, every step logged, validated after steps 3 and 6."""
    root = tmp_path_factory.mktemp("run")
    module = LogsKnownValues()
    trainer = Trainer(
        max_steps=6, val_check_interval=3, num_sanity_val_steps=0, log_every_n_steps=1, logger=CSVLogger(root),
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module)
    (metrics,) = root.glob("lightning_logs/version_*/metrics.csv")
    return metrics, module.logged


def test_curves_are_the_logged_points(run, tmp_path, capsys):
    metrics, logged = run
    assert read_curves(metrics, ["train/value"])["train/value"] == logged["train/value"]
    assert [value for _, value in read_curves(metrics, ["val/value"])["val/value"]] == [103.0, 106.0]
    output = tmp_path / "docs" / "curves.png"
    main(["curves", "--metrics", str(metrics), "--keys", "train/value", "val/value", "--output", str(output)])
    assert "train/value: 6 points, steps 0-5" in capsys.readouterr().out
    assert matplotlib.image.imread(output).shape[:2] == (560, 800)  # two panels: 1.2 + 2 * 2.2 inches high at 100 dpi


def test_curves_name_the_logged_metrics_when_a_key_is_not_one(run, tmp_path, capsys):
    metrics, _ = run
    with pytest.raises(SystemExit) as exit_info:
        main(["curves", "--metrics", str(metrics), "--keys", "val/acuracy", "--output", str(tmp_path / "x.png")])
    assert exit_info.value.code == 2
    assert f"{metrics} has no metric 'val/acuracy'; it logged: train/value, val/value." in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_a_folder_means_its_newest_metrics_file(run, tmp_path, capsys):
    metrics, _ = run
    main(["curves", "--metrics", str(metrics.parents[2]), "--keys", "train/value", "--output", str(tmp_path / "a.png")])
    assert f"from {metrics} (train/value: 6 points" in capsys.readouterr().out
    for version, age in (("version_10", 0), ("version_2", 100)):  # newest by time, not by name
        copy = tmp_path / "logs" / "lightning_logs" / version / "metrics.csv"
        copy.parent.mkdir(parents=True)
        copy.write_text(metrics.read_text())
        os.utime(copy, (copy.stat().st_mtime - age,) * 2)
    assert newest_metrics_file(tmp_path / "logs") == tmp_path / "logs" / "lightning_logs" / "version_10" / "metrics.csv"
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no metrics.csv under this folder"):
        newest_metrics_file(tmp_path / "empty")
