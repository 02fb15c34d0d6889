import csv
import math
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from equivalence import TINY_MODEL_TERMS, assert_equal_up_to_rounding
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.loggers import Logger
from matplotlib.image import imread
from torch.utils.data import DataLoader

from lit_memtrain.callbacks.positional_loss import PositionalLoss, PositionBucket, plot_loss_by_position
from lit_memtrain.datamodules.sft import SFTDataModule
from lit_memtrain.objectives.causal_lm import CausalLMModule


class RecordingLogger(Logger):
    """Keeps what log_metrics received, so a test can compare it with the files."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[int | None, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass

    def log_metrics(self, metrics, step=None) -> None:
        self.records.append((step, dict(metrics)))


def _trainer(callback: PositionalLoss, logger: Logger, tmp_path: Path) -> Trainer:
    return Trainer(
        accelerator="cpu",
        callbacks=[callback],
        logger=logger,
        default_root_dir=tmp_path,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )


def _read_csv(path: Path) -> list[PositionBucket]:
    with path.open() as file:
        rows = list(csv.DictReader(file))
    return [PositionBucket(int(r["start"]), int(r["end"]), float(r["mean_loss"]), int(r["tokens"])) for r in rows]


def _expected(module: CausalLMModule, batches, width: int) -> tuple[list[PositionBucket], float]:
    """Per-token losses from the model's full logits, bucketed by target position; entropy of the targets."""
    sums, counts, tokens = Counter(), Counter(), Counter()
    with torch.no_grad():
        for batch in batches:
            logits = module.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            for row in range(logits.shape[0]):
                for target_position in range(1, logits.shape[1]):
                    target = int(batch["labels"][row, target_position])
                    if target == -100:
                        continue
                    loss = F.cross_entropy(logits[row, target_position - 1].double(), torch.tensor(target)).item()
                    sums[target_position // width] += loss
                    counts[target_position // width] += 1
                    tokens[target] += 1
    buckets = [PositionBucket(b * width, (b + 1) * width, sums[b] / counts[b], counts[b]) for b in sorted(counts)]
    total = sum(tokens.values())
    entropy = -sum(n / total * math.log(n / total) for n in tokens.values())
    return buckets, entropy


def _tiny_module() -> CausalLMModule:
    torch.manual_seed(0)
    module = CausalLMModule(preset="tiny-qwen3", tokenizer="lit-memtrain/embedded")
    module.configure_model()
    return module


@pytest.fixture(scope="module")
def tiny():
    module = _tiny_module()
    data = SFTDataModule(max_length=48, val_size=24, batch_size=8, assistant_only_loss=False)
    data.setup("validate")
    return module, data


def test_table_matches_independent_per_token_losses_and_the_plot_shows_the_logged_values(tiny, tmp_path):
    module, data = tiny
    logger = RecordingLogger()
    trainer = _trainer(PositionalLoss(bucket_width=4, output_dir=str(tmp_path / "out")), logger, tmp_path)
    trainer.validate(module, datamodule=data, verbose=False)

    rows = _read_csv(tmp_path / "out" / "loss_by_position_step0.csv")
    expected, entropy = _expected(module, list(data.val_dataloader()), width=4)
    assert [(r.start, r.end, r.tokens) for r in rows] == [(e.start, e.end, e.tokens) for e in expected]
    assert sum(r.tokens for r in rows) == sum(int((b["labels"][:, 1:] != -100).sum()) for b in data.val_dataloader())
    losses = [r.mean_loss for r in rows]
    assert_equal_up_to_rounding(losses, [e.mean_loss for e in expected], name="mean losses", terms=TINY_MODEL_TERMS)
    assert len(rows) >= 6

    logged = next(metrics for step, metrics in logger.records if "val/unigram_entropy" in metrics)
    assert logged.pop("val/unigram_entropy") == pytest.approx(entropy, rel=1e-9)
    assert logged == {f"val/loss_by_position/{r.start}-{r.end}": r.mean_loss for r in rows}

    figure = plot_loss_by_position(rows, entropy)
    curve, reference = figure.axes[0].lines
    assert list(curve.get_ydata()) == [r.mean_loss for r in rows]
    assert list(curve.get_xdata()) == [(r.start + r.end) / 2 for r in rows]
    assert list(reference.get_ydata()) == [entropy, entropy]
    figure.savefig(tmp_path / "replot.png")
    written = imread(tmp_path / "out" / "loss_by_position_step0.png")
    assert written.shape == (400, 700, 4)
    np.testing.assert_array_equal(written, imread(tmp_path / "replot.png"))


def test_num_buckets_splits_the_positions_seen_evenly(tiny, tmp_path):
    module, data = tiny
    trainer = _trainer(PositionalLoss(num_buckets=4), RecordingLogger(), tmp_path)
    trainer.validate(module, datamodule=data, verbose=False)
    rows = _read_csv(tmp_path / "positional_loss" / "loss_by_position_step0.csv")
    longest = max(int(b["attention_mask"].sum(1).max()) for b in data.val_dataloader())
    width = math.ceil(longest / 4)
    assert [(r.start, r.end) for r in rows] == [(i * width, (i + 1) * width) for i in range(4)]


def test_packed_rows_are_bucketed_by_position_in_document(tiny, tmp_path):
    module, padded = tiny
    packed = SFTDataModule(max_length=48, val_size=24, batch_size=8, assistant_only_loss=False, packing=True)
    tables = {}
    for name, data in (("padded", padded), ("packed", packed)):
        logger = RecordingLogger()
        _trainer(PositionalLoss(bucket_width=4, output_dir=str(tmp_path / name)), logger, tmp_path).validate(
            module, datamodule=data, verbose=False
        )
        entropy = next(m["val/unigram_entropy"] for _, m in logger.records if "val/unigram_entropy" in m)
        tables[name] = (_read_csv(tmp_path / name / "loss_by_position_step0.csv"), entropy)
    (padded_rows, padded_entropy), (packed_rows, packed_entropy) = tables["padded"], tables["packed"]
    assert max(int(b["input_ids"].shape[-1]) for b in packed.val_dataloader()) > 48  # documents share rows
    assert [(r.start, r.end, r.tokens) for r in packed_rows] == [(r.start, r.end, r.tokens) for r in padded_rows]
    losses = [r.mean_loss for r in packed_rows]
    assert_equal_up_to_rounding(losses, [r.mean_loss for r in padded_rows], name="mean losses", terms=TINY_MODEL_TERMS)
    assert packed_entropy == pytest.approx(padded_entropy, rel=1e-12)


class NoTokenLosses(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 2)

    def validation_step(self, batch, batch_idx):
        return {"loss": self.layer(batch["x"]).sum()}

    def val_dataloader(self):
        batch = {"x": torch.ones(1, 2), "labels": torch.ones(1, 3, dtype=torch.long)}
        return DataLoader([batch], batch_size=None)


def test_module_without_token_losses_gets_an_error_naming_the_keys(tmp_path):
    trainer = _trainer(PositionalLoss(), RecordingLogger(), tmp_path)
    with pytest.raises(ValueError, match=r"NoTokenLosses.validation_step to return a dict with 'token_losses'") as info:
        trainer.validate(NoTokenLosses(), verbose=False)
    assert "missing ['token_losses', 'token_positions'], got ['loss']" in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"bucket_width": 8, "num_buckets": 4}, "not both"),
        ({"bucket_width": 0}, "bucket_width must be a positive"),
        ({"num_buckets": -1}, "num_buckets must be a positive"),
    ],
)
def test_invalid_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PositionalLoss(**kwargs)


def test_two_ranks_write_the_table_of_all_their_tokens(tiny, tmp_path):
    module, data = tiny
    single = _trainer(PositionalLoss(bucket_width=4, output_dir=str(tmp_path / "single")), RecordingLogger(), tmp_path)
    single.validate(module, datamodule=data, verbose=False)
    # A fresh module with the same weights: under gloo, validation runs in no_grad, and the metric states the
    # first validation left in inference mode cannot be updated outside it.
    module = _tiny_module()
    callback = PositionalLoss(bucket_width=4, output_dir=str(tmp_path / "ddp"))
    trainer = Trainer(
        accelerator="cpu", devices=2, strategy="ddp_fork", callbacks=[callback], logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
    )
    trainer.validate(module, datamodule=data, verbose=False)
    expected = _read_csv(tmp_path / "single" / "loss_by_position_step0.csv")
    rows = _read_csv(tmp_path / "ddp" / "loss_by_position_step0.csv")
    assert len(data.val_dataset) % 2 == 0  # no sample is repeated to even out the ranks
    assert [(r.start, r.end, r.tokens) for r in rows] == [(e.start, e.end, e.tokens) for e in expected]
    losses = [r.mean_loss for r in rows]
    assert_equal_up_to_rounding(losses, [e.mean_loss for e in expected], name="mean losses", terms=TINY_MODEL_TERMS)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_table_equals_the_cpu_table(tiny, tmp_path):
    _, data = tiny
    for accelerator in ("cpu", "gpu"):
        callback = PositionalLoss(bucket_width=4, output_dir=str(tmp_path / accelerator))
        trainer = Trainer(
            accelerator=accelerator, devices=1, callbacks=[callback], logger=False,
            enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        )
        trainer.validate(_tiny_module(), datamodule=data, verbose=False)
    cpu, gpu = (_read_csv(tmp_path / name / "loss_by_position_step0.csv") for name in ("cpu", "gpu"))
    assert [(r.start, r.end, r.tokens) for r in gpu] == [(r.start, r.end, r.tokens) for r in cpu]
    losses = [r.mean_loss for r in gpu]
    assert_equal_up_to_rounding(losses, [r.mean_loss for r in cpu], name="mean losses", terms=TINY_MODEL_TERMS)
