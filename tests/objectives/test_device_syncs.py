"""A packed (padding-free) SFT training step makes the host wait for the device only where listed here.

Why exact: each host read of a device value (or blocking copy to it) stalls the host until the GPU drains, and the
H200 fit of Qwen3-0.6B ran at 15.8% MFU with eleven of them a step. They are counted on a CPU by
:class:`~device_syncs.DeviceSyncCounter`, which follows which tensors a CUDA run would hold on the device.
"""

import torch
from device_syncs import TRAINING_DEVICE, DeviceSyncCounter
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.strategies import SingleDeviceStrategy
from tiny_models import TINY_OVERRIDES

from lit_memtrain.datamodules.sft import SFTDataModule
from lit_memtrain.objectives.causal_lm import CausalLMModule

# What is left, each with why it stays (operation and function, in the order a step makes them):
EXPECTED_PER_STEP = [
    # transformers' create_causal_mask asks whether position_ids restart (find_packed_sequence_indices): its code.
    "__bool__ in find_packed_sequence_indices",
    # the per-document attention's mask function is probed on the device for blockwise or one-document rows.
    "__bool__ in _mask_or_document_ids",
    "__bool__ in _mask_or_document_ids",
    # the chunked loss gathers the trainable rows (a data-dependent size).
    "nonzero in chunked_cross_entropy",
    # Lightning turns progress-bar tensors into numbers at every step (train/loss, a device tensor), and again at a
    # step that logs (every step here: log_every_n_steps=1).
    "item in to_item",
    "item in to_item",
]


class _Windows(Callback):
    """Counts from each training batch's start to the next: its step, its logging, the next batch's transfer."""

    def __init__(self, counter: DeviceSyncCounter) -> None:
        self.counter = counter

    def on_train_start(self, trainer, module):
        self.counter.mark_device(module)  # the parameters, made before the fit knew its device
        move = trainer.strategy.batch_to_device

        def moved(batch, *args, **kwargs):  # Lightning's transfer is non_blocking on CUDA: not a sync
            window, self.counter.window = self.counter.window, None
            batch = move(batch, *args, **kwargs)
            self.counter.mark_device(batch)
            self.counter.window = window
            return batch

        trainer.strategy.batch_to_device = moved

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.counter.window = batch_idx

    def on_train_end(self, trainer, module):
        self.counter.window = None
        del trainer.strategy.batch_to_device


def _packed_fit_syncs(steps: int) -> dict[int, list[str]]:
    counter = DeviceSyncCounter()
    torch.manual_seed(0)
    module = CausalLMModule(preset="tiny-qwen3", config_overrides=TINY_OVERRIDES, tokenizer="lit-memtrain/embedded")
    data = SFTDataModule(max_length=40, packing=True, batch_size=2)
    make_collator = data.collator
    data.collator = lambda: (lambda rows, collate=make_collator(): counter.mark_host(collate(rows)))
    trainer = Trainer(
        accelerator="cpu", strategy=SingleDeviceStrategy(TRAINING_DEVICE), max_steps=steps, log_every_n_steps=1,
        logger=False, enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
        callbacks=[_Windows(counter)],
    )  # fmt: skip
    with counter:
        trainer.fit(module, datamodule=data)
    assert module.model.config._attn_implementation == "sdpa_by_document"
    return counter.per_window()


def test_a_packed_sft_step_syncs_only_where_listed():
    windows = _packed_fit_syncs(steps=4)
    for step in (1, 2):  # the first step also probes the model; the last ends the fit
        events = windows.get(step, [])
        found = [f"{event.split(' at ')[0]} in {event.rsplit(' ', 1)[1]}" for event in events]
        assert found == EXPECTED_PER_STEP, (
            f"step {step} makes {len(events)} host<->device syncs, {len(EXPECTED_PER_STEP)} expected:\n  "
            + "\n  ".join(events)
        )


def test_the_counter_sees_a_read_and_a_blocking_copy_but_not_host_work():
    counter = DeviceSyncCounter()
    with counter:
        counter.window = 0
        host = counter.mark_host(torch.arange(4))
        int(host.sum())  # host work: not a sync
        on_device = host.to(TRAINING_DEVICE, non_blocking=True)
        torch.full((), 3, device=TRAINING_DEVICE)
        bool((on_device > 1).any())
        torch.tensor(5, device=TRAINING_DEVICE)
        on_device.tolist()
        on_device.cpu().tolist()  # one read: the copy; the host copy's tolist is host work
    assert [event.split(" at ")[0] for event in counter.per_window()[0]] == [
        "__bool__", "tensor (blocking copy to the device)", "tolist", "cpu"
    ]
