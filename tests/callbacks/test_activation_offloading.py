"""Activation offloading: same gradients, exact offload counts, no leak, lower simulated peak, Lightning wiring.

CPU tests run the real path with ``offload_cpu_tensors_for_testing=True`` (host copies are CPU clones).
"""

from __future__ import annotations

import json
import warnings

import lightning as L
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from equivalence import TINY_MODEL_TERMS, assert_equal_up_to_rounding
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from transformers import AutoModelForCausalLM

from lit_memtrain.callbacks.activation_offloading import ActivationOffloading
from lit_memtrain.techniques.checkpointing import apply_checkpointing
from lit_memtrain.models.layers import find_decoder_layers
from lit_memtrain.techniques.loss import chunked_cross_entropy
from lit_memtrain.techniques.offload import ActivationOffloader
from lit_memtrain.models.presets import build_config
from lit_memtrain.techniques.tiled_mlp import apply_tiled_mlp

B, S, H, I, V, LAYERS = 2, 32, 16, 24, 50, 3


class Block(nn.Module):
    """A gated MLP block: saves x (once, shared by two matmuls), gate, silu(gate), up and their product."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(H, I, bias=False)
        self.up = nn.Linear(H, I, bias=False)
        self.down = nn.Linear(I, H, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.silu(self.gate(x)) * self.up(x))


class PlainLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, H)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(H, V, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _plain_lm_loss(model: PlainLM, input_ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(input_ids).flatten(0, 1), input_ids.flatten())


def _qwen3(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(build_config("tiny-qwen3"), attn_implementation="sdpa")


def _qwen3_loss(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    hidden = model.model(input_ids=input_ids, use_cache=False).last_hidden_state
    targets = F.pad(input_ids[:, 1:], (0, 1), value=-100)
    return chunked_cross_entropy(hidden.flatten(0, 1), model.lm_head.weight, targets.flatten(), chunk_size=40)


def _qwen3_hf_loss(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=input_ids, labels=input_ids, use_cache=False).loss


def _loss_and_grads(model, loss_fn, input_ids, offloader=None):
    model.zero_grad(set_to_none=True)
    if offloader is None:
        loss = loss_fn(model, input_ids)
        loss.backward()
    else:
        with offloader:
            loss = loss_fn(model, input_ids)
            loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _assert_same(expected, got, exact=True):
    """Same loss and gradients: bit for bit on the CPU; CUDA kernels may reorder sums between runs."""
    assert len(expected[1]) == len(got[1]) > 0
    for index, (have, want) in enumerate([(got[0], expected[0]), *zip(got[1], expected[1])]):
        name = f"gradient {index - 1}" if index else "loss"
        if exact:
            torch.testing.assert_close(have, want, rtol=0, atol=0, msg=name)
        else:  # the CUDA test's 2 x 256 tokens: twice the nested sums of the tiny models' usual rows
            assert_equal_up_to_rounding(have, want, name=name, terms=2 * TINY_MODEL_TERMS)


@pytest.mark.parametrize("technique", ["none", "checkpointing", "checkpointing+tiled_mlp"])
def test_gradients_identical_with_offloading(technique):
    model = _qwen3()
    layers = find_decoder_layers(model)
    if "checkpointing" in technique:
        apply_checkpointing(layers)
    if "tiled_mlp" in technique:
        apply_tiled_mlp(layers, num_tiles=4)
    input_ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(1))
    expected = _loss_and_grads(model, _qwen3_loss, input_ids)
    offloader = ActivationOffloader(model, offload_cpu_tensors_for_testing=True, max_fwd_stash_size=1)
    _assert_same(expected, _loss_and_grads(model, _qwen3_loss, input_ids, offloader))
    assert offloader.stats.tensors >= len(layers)
    assert offloader.host_bytes == 0


def test_gradients_identical_with_lora():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(_qwen3(), peft.LoraConfig(r=4, target_modules="all-linear", lora_dropout=0.1))
    model.train()
    input_ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(1))

    def loss_fn(peft_model, ids):
        torch.manual_seed(3)  # same dropout masks in both runs
        return _qwen3_hf_loss(peft_model, ids)

    expected = _loss_and_grads(model, loss_fn, input_ids)
    offloader = ActivationOffloader(model, offload_cpu_tensors_for_testing=True, min_offload_bytes=0)
    _assert_same(expected, _loss_and_grads(model, loss_fn, input_ids, offloader))
    assert offloader.stats.tensors > 0


def test_gradients_identical_with_fsdp2_and_no_weight_offloaded():
    from torch.distributed.fsdp import fully_shard

    input_ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(1))
    plain = _qwen3()
    plain_offloader = ActivationOffloader(plain, offload_cpu_tensors_for_testing=True, min_offload_bytes=0)
    expected = _loss_and_grads(plain, _qwen3_hf_loss, input_ids, plain_offloader)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = _qwen3()
        for layer in find_decoder_layers(model):
            fully_shard(layer)
        fully_shard(model)
        offloader = ActivationOffloader(model, offload_cpu_tensors_for_testing=True, min_offload_bytes=0)
        loss, grads = _loss_and_grads(model, _qwen3_hf_loss, input_ids, offloader)
        _assert_same(expected, (loss, [grad.full_tensor() for grad in grads]))
    finally:
        dist.destroy_process_group()
    # The unsharded weights FSDP2 gathers inside each layer are matched by storage and never offloaded.
    assert offloader.stats == plain_offloader.stats


def test_offloads_exactly_the_activations_of_each_layer():
    model = PlainLM()
    input_ids = torch.randint(0, V, (B, S))
    offloader = ActivationOffloader(model, offload_cpu_tensors_for_testing=True, min_offload_bytes=0)
    _loss_and_grads(model, _plain_lm_loss, input_ids, offloader)
    # x (saved by gate and up as two views, copied once), gate, silu(gate), up, product; no weight views,
    # nothing from the embedding or the head.
    assert offloader.stats.tensors_per_layer == [5] * LAYERS
    assert offloader.stats.bytes_per_layer == [B * S * (H + 4 * I) * 4] * LAYERS
    assert offloader.stats.peak_host_bytes == LAYERS * B * S * (H + 4 * I) * 4


class SharedStorageBlock(nn.Module):
    """Saves one storage as two views, as the math attention kernel saves its softmax output and a batched view of
    it: softmax saves ``p``, ``bmm(p, p^T)`` saves ``p`` and its transpose. Also saves ``x`` (by the projection and
    the last bmm, same view) and ``y``."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(H, H, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.proj(x).softmax(-1)
        y = torch.bmm(p, p.transpose(1, 2))
        return x + torch.bmm(y, x)


def test_views_of_one_storage_are_copied_to_the_host_once_and_rebuilt_exactly():
    model = PlainLM()
    model.layers = nn.ModuleList(SharedStorageBlock() for _ in range(LAYERS))
    input_ids = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(2))
    expected = _loss_and_grads(model, _plain_lm_loss, input_ids)
    offloader = ActivationOffloader(
        model, offload_cpu_tensors_for_testing=True, min_offload_bytes=0, max_fwd_stash_size=0
    )
    _assert_same(expected, _loss_and_grads(model, _plain_lm_loss, input_ids, offloader))
    # x, p (once, though saved as p twice and as p^T) and y: three storages, each copied whole once.
    assert offloader.stats.tensors_per_layer == [3] * LAYERS
    assert offloader.stats.bytes_per_layer == [(2 * B * S * H + B * S * S) * 4] * LAYERS
    assert offloader.stats.peak_host_bytes == offloader.stats.bytes


def _distinct_storages_saved_in_layers(model: nn.Module, input_ids: torch.Tensor) -> tuple[list[int], list[int], int]:
    """Per layer, the storages of what autograd saves inside it (parameters' aside; one saved in several layers,
    such as the rotary cos and sin, counts in the first) and their bytes, counted by hooks of our own; and how
    many storages were saved as more than one view."""
    layers = find_decoder_layers(model)
    current: list[int | None] = [None]
    parameters = {param.untyped_storage()._cdata for param in model.parameters()}
    storages: list[dict[int, int]] = [{} for _ in layers]
    views: dict[int, set] = {}
    kept = []  # the saved tensors, so that no storage is freed and its address reused while counting

    def pack(tensor):
        storage = tensor.untyped_storage()
        if current[0] is not None and storage._cdata not in parameters:
            if not any(storage._cdata in earlier for earlier in storages[: current[0]]):
                storages[current[0]][storage._cdata] = storage.nbytes()
            views.setdefault(storage._cdata, set()).add((tensor.storage_offset(), tensor.shape, tensor.stride()))
            kept.append(tensor)
        return tensor

    handles = [hook for index, layer in enumerate(layers) for hook in (
        layer.register_forward_pre_hook(lambda module, args, index=index: current.__setitem__(0, index)),
        layer.register_forward_hook(lambda module, args, output: current.__setitem__(0, None)),
    )]  # fmt: skip
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        _qwen3_loss(model, input_ids)
    for handle in handles:
        handle.remove()
    shared = sum(len(found) > 1 for found in views.values())
    return [len(found) for found in storages], [sum(found.values()) for found in storages], shared


def test_eager_attention_offloads_each_storage_it_saves_once():
    """Eager attention saves its softmax output and the batched view of it its matmul makes (the math kernel of
    fp32 grouped-query SDPA on a GPU does the same): one host copy each, gradients unchanged."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(build_config("tiny-qwen3"), attn_implementation="eager")
    input_ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(1))
    counts, nbytes, shared = _distinct_storages_saved_in_layers(model, input_ids)
    assert shared >= len(counts)  # at least the softmax output of each layer is saved as two views
    expected = _loss_and_grads(model, _qwen3_loss, input_ids)
    offloader = ActivationOffloader(
        model, offload_cpu_tensors_for_testing=True, min_offload_bytes=0, max_fwd_stash_size=0
    )
    _assert_same(expected, _loss_and_grads(model, _qwen3_loss, input_ids, offloader))
    assert offloader.stats.tensors_per_layer == counts
    assert offloader.stats.bytes_per_layer == nbytes


def test_min_offload_bytes_keeps_small_tensors():
    model = PlainLM()
    offloader = ActivationOffloader(
        model, offload_cpu_tensors_for_testing=True, min_offload_bytes=B * S * H * 4 + 1
    )
    _loss_and_grads(model, _plain_lm_loss, torch.randint(0, V, (B, S)), offloader)
    assert offloader.stats.tensors_per_layer == [4] * LAYERS
    assert offloader.stats.bytes_per_layer == [B * S * 4 * I * 4] * LAYERS


def test_checkpointed_layers_offload_one_input_each():
    model = _qwen3()
    apply_checkpointing(find_decoder_layers(model))
    input_ids = torch.randint(0, 512, (2, 64))
    offloader = ActivationOffloader(model, offload_cpu_tensors_for_testing=True)
    _loss_and_grads(model, _qwen3_loss, input_ids, offloader)
    hidden = model.config.hidden_size
    assert offloader.stats.tensors_per_layer == [1, 1]
    assert offloader.stats.bytes_per_layer == [2 * 64 * hidden * 4] * 2


def test_fifty_steps_hold_no_growing_host_memory():
    model = PlainLM()
    input_ids = torch.randint(0, V, (B, S))
    offloader = ActivationOffloader(model, offload_cpu_tensors_for_testing=True, min_offload_bytes=0)
    peaks, released = [], []
    for _ in range(50):
        with offloader:
            loss = _plain_lm_loss(model, input_ids)
            host_storages = [StorageWeakRef(r.host.untyped_storage()) for r in offloader._records.values()]
            peaks.append(offloader.host_bytes)
            loss.backward()
        released.append(all(ref.expired() for ref in host_storages) and offloader.host_bytes == 0)
    assert peaks == [LAYERS * B * S * (H + 4 * I) * 4] * 50
    assert all(released)


def test_backward_after_exit_raises_clear_error():
    model = PlainLM()
    offloader = ActivationOffloader(model, offload_cpu_tensors_for_testing=True, max_fwd_stash_size=0)
    with offloader:
        loss = _plain_lm_loss(model, torch.randint(0, V, (B, S)))
    with pytest.raises(RuntimeError, match="backward ran after the ActivationOffloader context exited"):
        loss.backward()


def test_cpu_tensors_stay_without_test_mode():
    model = PlainLM()
    offloader = ActivationOffloader(model)
    _loss_and_grads(model, _plain_lm_loss, torch.randint(0, V, (B, S)), offloader)
    assert offloader.stats.tensors == 0


def test_warns_once_when_host_ram_is_high(monkeypatch):
    monkeypatch.setattr("lit_memtrain.techniques.offload._host_ram_percent", lambda: 75.0)
    model = PlainLM()
    offloader = ActivationOffloader(model, offload_cpu_tensors_for_testing=True)
    with pytest.warns(UserWarning, match="Host RAM is 75% used"):
        _loss_and_grads(model, _plain_lm_loss, torch.randint(0, V, (B, S)), offloader)
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        _loss_and_grads(model, _plain_lm_loss, torch.randint(0, V, (B, S)), offloader)
    assert not [r for r in records if "Host RAM" in str(r.message)]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"min_offload_bytes": -1}, "min_offload_bytes must be"),
        ({"max_fwd_stash_size": -2}, "max_fwd_stash_size must be"),
    ],
)
def test_invalid_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ActivationOffloader(PlainLM(), **kwargs)
    with pytest.raises(ValueError, match=message):
        ActivationOffloading(**kwargs)


def test_model_without_layers_is_refused():
    with pytest.raises(ValueError, match="Could not find decoder layers"):
        ActivationOffloader(nn.Sequential(nn.Linear(2, 2)))


_SIMULATION = """
import json
import lit_memtrain.planner.simulate as simulate
from lit_memtrain.techniques.offload import ActivationOffloader
from lit_memtrain.models.presets import build_config

config = build_config("qwen3-4b", {"num_hidden_layers": 3})
baseline = simulate.simulate_step(config, 65536, loss="plain", checkpointing="full")
offloaders = []
step_loss = simulate._step_loss

def offloaded_step_loss(model, *args, **kwargs):
    # simulate_step has no offloading option: open the context where it computes the loss; it stays
    # open through the backward that simulate_step runs next.
    offloaders.append(ActivationOffloader(model, max_fwd_stash_size=1).__enter__())
    return step_loss(model, *args, **kwargs)

simulate._step_loss = offloaded_step_loss
offloaded = simulate.simulate_step(config, 65536, loss="plain", checkpointing="full")
offloaders[0].__exit__(None, None, None)
print(json.dumps({
    "device_drop": baseline.device_peak - offloaded.device_peak,
    "host_rise": offloaded.host_peak - baseline.host_peak,
    "tensors_per_layer": offloaders[0].stats.tensors_per_layer,
}))
"""


def test_simulated_peak_drops_by_the_offloaded_layer_inputs(preloaded_python):
    """Qwen3-4B width, 3 checkpointed layers, 64k tokens, stash of 1: at the peak (the plain loss), every
    layer input but the stashed one has moved from the device to the host.

    In a child process of ``preloaded_python`` (tests/conftest.py): the simulation's stand-in device must exist
    before the process's first backward.
    """
    pytest.importorskip("lit_memtrain.planner.simulate")
    result = preloaded_python.run("-c", _SIMULATION, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    layer_input = 65536 * 2560 * 2
    assert measured["tensors_per_layer"] == [1, 1, 1]
    assert measured["device_drop"] == 2 * layer_input
    assert measured["host_rise"] == 3 * layer_input


class _FakeStream:
    """Records the stream calls the offloader makes, so their order can be checked without a GPU."""

    log: list[tuple] = []

    def __init__(self, name: str = "copy") -> None:
        self.name = name

    def wait_stream(self, other: _FakeStream) -> None:
        self.log.append(("wait_stream", self.name, other.name))

    def record_event(self) -> int:
        event = len([entry for entry in self.log if entry[0] == "record"])
        self.log.append(("record", self.name, event))
        return event

    def wait_event(self, event: int) -> None:
        self.log.append(("wait_event", self.name, event))


def test_stream_path_orders_copies_on_the_current_compute_stream(monkeypatch):
    import contextlib

    _FakeStream.log = log = []
    current = [_FakeStream("compute")]

    @contextlib.contextmanager
    def use_stream(stream):
        previous, current[0] = current[0], stream
        yield
        current[0] = previous

    model = PlainLM()
    input_ids = torch.randint(0, V, (B, S))
    expected = _loss_and_grads(model, _plain_lm_loss, input_ids)
    offloader = ActivationOffloader(
        model, offload_cpu_tensors_for_testing=True, min_offload_bytes=0, max_fwd_stash_size=2
    )
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[0])
    monkeypatch.setattr(torch.cuda, "stream", use_stream)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: _FakeStream("copy"))
    monkeypatch.setattr(ActivationOffloader, "_uses_streams", lambda self, device: True)
    # The last layer runs on another compute stream, as FSDP2 or user code may do.
    model.layers[-1].register_forward_pre_hook(lambda module, args: current.__setitem__(0, _FakeStream("other")))
    model.layers[-1].register_forward_hook(lambda module, args, out: current.__setitem__(0, _FakeStream("compute")))
    _assert_same(expected, _loss_and_grads(model, _plain_lm_loss, input_ids, offloader))
    records = [index for index, entry in enumerate(log) if entry[0] == "record"]
    # Every copy waits for the compute stream current at that moment, and is on the copy stream.
    assert all(log[index - 1][:2] == ("wait_stream", "copy") and log[index][1] == "copy" for index in records)
    assert [log[index - 1][2] for index in records[: 5 * LAYERS]] == ["compute"] * 10 + ["other"] * 5
    # Compute waits for every copy before its device tensor is used or released.
    assert sorted(entry[2] for entry in log if entry[0] == "wait_event") == list(range(len(records)))
    assert {entry[1] for entry in log if entry[0] == "wait_event"} <= {"compute", "other"}


class _PlainLMModule(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lm = PlainLM()

    def training_step(self, batch, batch_idx):
        return _plain_lm_loss(self.lm, batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def _fit(callbacks, accumulate_grad_batches=1):
    module = _PlainLMModule()
    data = torch.randint(0, V, (8, B, S), generator=torch.Generator().manual_seed(2))
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=3,
        accumulate_grad_batches=accumulate_grad_batches,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, torch.utils.data.DataLoader(list(data), batch_size=None))
    return [p.detach().clone() for p in module.parameters()]


@pytest.mark.parametrize("accumulate_grad_batches", [1, 2])
def test_trainer_with_callback_trains_identically(accumulate_grad_batches):
    callback = ActivationOffloading(offload_cpu_tensors_for_testing=True, min_offload_bytes=0, max_fwd_stash_size=2)
    expected = _fit([], accumulate_grad_batches)
    got = _fit([callback], accumulate_grad_batches)
    for want, have in zip(expected, got):
        assert torch.equal(want, have)
    assert callback.offloader.stats.tensors_per_layer == [5] * LAYERS
    assert not callback.offloader.active


def test_callback_warns_that_cpu_training_offloads_nothing():
    with pytest.warns(UserWarning, match="does nothing when training on the CPU"):
        ActivationOffloading().on_fit_start(L.Trainer(accelerator="cpu", logger=False), _PlainLMModule())


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("use_streams", [True, False])
def test_cuda_gradients_identical_and_host_copies_pinned(use_streams):
    model = _qwen3().cuda()
    apply_checkpointing(find_decoder_layers(model))
    input_ids = torch.randint(0, 512, (2, 256), device="cuda")
    expected = _loss_and_grads(model, _qwen3_loss, input_ids)
    offloader = ActivationOffloader(model, use_streams=use_streams, max_fwd_stash_size=0)
    pinned = []
    with offloader:
        loss = _qwen3_loss(model, input_ids)
        pinned = [r.host.is_pinned() for r in offloader._records.values()]
        model.zero_grad(set_to_none=True)
        loss.backward()
    got = (loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None])
    _assert_same(expected, got, exact=False)
    assert pinned == [True, True]


@pytest.mark.gpu
@cuda
def test_cuda_peak_memory_drops():
    model = AutoModelForCausalLM.from_config(
        build_config("tiny-qwen3", {"hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 6}),
        attn_implementation="sdpa",
    ).cuda()
    input_ids = torch.randint(0, 512, (1, 8192), device="cuda")

    def peak(offloader):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        _loss_and_grads(model, _qwen3_loss, input_ids, offloader)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()

    peak(None)
    offloader = ActivationOffloader(model, max_fwd_stash_size=2)
    baseline, offloaded = peak(None), peak(offloader)
    # What left the device (one copy per storage: fp32 grouped-query SDPA takes the math kernel, which saves its
    # softmax output and a view of it) and stayed off it at the peak: all but the last layer's (the two stashed,
    # or brought back first in backward) and one prefetched record (at most a layer's).
    stayed_off = offloader.stats.bytes - 2 * max(offloader.stats.bytes_per_layer)
    assert offloaded <= baseline - stayed_off, (baseline, offloaded, offloader.stats)
