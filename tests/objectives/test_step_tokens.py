"""Each training batch carries the trainable tokens of its whole optimizer step, with Lightning's own step
boundaries: every accumulate_grad_batches batches and at the end of a (limited) epoch."""

import math

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from torch.utils.data import DataLoader

from lit_memtrain.datamodules.collate import PaddedCollator
from lit_memtrain.objectives.causal_lm import CausalLMModule
from lit_memtrain.objectives.step_tokens import STEP_TRAINABLE_TOKENS, STEP_WINDOW, StepTokenCounts, StepWindow


def _counted(counts, per_step, position=lambda: (0, math.inf)):
    batches = [{"n": n} for n in counts]
    return [batch[STEP_TRAINABLE_TOKENS] for batch in StepTokenCounts(batches, per_step, lambda b: b["n"], position)]


def test_every_batch_carries_the_sum_of_its_step():
    assert _counted([3, 1, 2, 5, 4], 2) == [4, 4, 7, 7, 4]
    assert _counted([3, 1, 2], 1) == [3, 1, 2]


def test_every_batch_carries_its_step_and_each_epoch_reads_its_own_accumulation():
    accumulation = iter([1, 2])
    tagged = StepTokenCounts([{"n": 3}, {"n": 1}, {"n": 2}], lambda: next(accumulation), lambda b: b["n"])
    assert [b[STEP_WINDOW] for b in tagged] == [StepWindow(1, 1)] * 3
    assert [(b[STEP_TRAINABLE_TOKENS], b[STEP_WINDOW]) for b in tagged] == [
        (4, StepWindow(2, 2)), (4, StepWindow(2, 2)), (2, StepWindow(1, 2))
    ]


def test_steps_end_where_the_epoch_is_cut_and_start_where_a_resumed_epoch_restarts():
    assert _counted([3, 1, 2, 5, 4], 2, lambda: (0, 3)) == [4, 4, 2]  # limit_train_batches=3
    # Resumed after one batch, the loader restarts: its first batch ends the interrupted step, then 1 + 5.
    assert _counted([3, 1, 5, 7], 2, lambda: (1, 4)) == [3, 6, 6]


def test_bad_arguments_and_batches_are_refused():
    with pytest.raises(ValueError, match="micro_batches_per_step must be >= 1"):
        StepTokenCounts([], 0, len)
    with pytest.raises(ValueError, match="micro_batches_per_step must be >= 1, got 0"):
        list(StepTokenCounts([{}], lambda: 0, len))
    with pytest.raises(TypeError, match="needs dict batches; the training dataloader yields list"):
        list(StepTokenCounts([[1]], 1, len))


EXAMPLES = [
    {"input_ids": [5, 6, 7, 8, 9], "labels": [-100, 6, 7, 8, 9]},  # 4 trainable targets: 6 7 8 9
    {"input_ids": [3, 4, 5], "labels": [-100, -100, 5]},  # 1
    {"input_ids": [3, 4, 5, 6], "labels": [-100, 4, 5, 6]},  # 3
]


class SeenCounts(Callback):
    def __init__(self):
        self.counts = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.counts.append(batch[STEP_TRAINABLE_TOKENS])


def test_the_trainer_tags_batches_with_its_own_step_boundaries(tmp_path):
    seen = SeenCounts()
    module = CausalLMModule(preset="tiny-qwen3")
    module.configure_model()
    loader = DataLoader(EXAMPLES * 2, batch_size=1, collate_fn=PaddedCollator(pad_token_id=0))
    trainer = Trainer(
        max_epochs=2, limit_train_batches=3, accumulate_grad_batches=2, callbacks=[seen], logger=False,
        enable_progress_bar=False, enable_checkpointing=False, default_root_dir=tmp_path,
    )
    trainer.fit(module, loader)
    assert seen.counts == [5, 5, 3] * 2
    assert trainer.global_step == 4
    assert "process_dataloader" not in vars(trainer.strategy)  # restored at teardown
