"""GPU check: activation offloading, peak memory and step time, side by side in one run.

A Qwen3-4B-shaped model (hidden 2560, MLP 9728, vocabulary 151,936) with fewer layers and random bf16
weights runs forward + chunked loss + backward on one sequence. Each setting is measured after a warm-up
step, in the same process, on the same weights and tokens:

- ``checkpointing``: non-reentrant checkpointing of every layer (the reference for the next two);
- ``checkpointing + offload``: the same with :class:`lit_memtrain.offload.ActivationOffloader`;
- ``offloaded checkpoints``: checkpointing with each layer's input held by ``save_on_cpu``;
- ``no checkpointing`` and ``no checkpointing + offload``: every activation of the layers offloaded.

Printed per setting: peak allocated memory (``torch.cuda.max_memory_allocated``), the part of it above the
memory held before the step (weights), median step time, bytes offloaded, and ratios against the
reference; plus the largest relative gradient difference against the reference (offloading must not change
the gradients). Needs only torch and transformers.

Run from the repository root (about 1-2 minutes on one H200)::

    PYTHONPATH=. python benchmarks/gpu/offload.py
    PYTHONPATH=. python benchmarks/gpu/offload.py --seq-len 65536 --layers 8
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from lit_memtrain.allocator import enable_expandable_segments

enable_expandable_segments()

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from lit_memtrain.checkpointing import apply_checkpointing  # noqa: E402
from lit_memtrain.layers import find_decoder_layers  # noqa: E402
from lit_memtrain.loss import chunked_cross_entropy  # noqa: E402
from lit_memtrain.offload import ActivationOffloader  # noqa: E402
from lit_memtrain.presets import build_config  # noqa: E402

GIB = 2**30


def build_model(layers: int) -> torch.nn.Module:
    config = build_config("qwen3-4b", {"num_hidden_layers": layers})
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    model.train()
    return model


def step(model: torch.nn.Module, input_ids: torch.Tensor, offloader: ActivationOffloader | None) -> None:
    model.zero_grad(set_to_none=True)
    targets = torch.roll(input_ids, -1, dims=1)
    targets[:, -1] = -100

    def forward_backward() -> None:
        hidden = model.model(input_ids=input_ids, use_cache=False).last_hidden_state
        loss = chunked_cross_entropy(hidden.flatten(0, 1), model.lm_head.weight, targets.flatten())
        loss.backward()

    if offloader is None:
        forward_backward()
    else:
        with offloader:
            forward_backward()


def measure(model, input_ids, offloader, steps: int) -> dict[str, float]:
    step(model, input_ids, offloader)  # warm-up: kernels, pinned-memory cache, allocator segments
    times, peaks, above = [], [], []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        step(model, input_ids, offloader)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        peaks.append(torch.cuda.max_memory_allocated())
        above.append(peaks[-1] - before)
    return {
        "peak": max(peaks) / GIB,
        "above_weights": max(above) / GIB,
        "time": statistics.median(times),
        "offloaded": (offloader.stats.bytes / GIB) if offloader is not None else 0.0,
        "grads": [p.grad.float().clone() for p in model.parameters() if p.grad is not None][-8:],
    }


def max_relative_difference(reference: list[torch.Tensor], other: list[torch.Tensor]) -> float:
    return max(float((a - b).norm() / b.norm().clamp_min(1e-12)) for a, b in zip(other, reference))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, default=32768, help="tokens, settings with checkpointing")
    parser.add_argument(
        "--plain-seq-len", type=int, default=8192,
        help="tokens, settings without checkpointing (every activation goes to pinned host memory)",
    )
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--stash", type=int, default=1, help="max_fwd_stash_size with checkpointing")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/gpu/offload.py needs a CUDA GPU and none is available: nothing was measured.")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, layers {args.layers}, Qwen3-4B width, "
          f"bf16, chunked loss; {args.seq_len} tokens with checkpointing, {args.plain_seq_len} without", flush=True)
    model = build_model(args.layers)
    layers = find_decoder_layers(model)
    generator = torch.Generator("cuda").manual_seed(1)
    input_ids = torch.randint(0, model.config.vocab_size, (1, args.seq_len), device="cuda", generator=generator)

    results: dict[str, dict] = {}
    restore = apply_checkpointing(layers)
    results["checkpointing"] = measure(model, input_ids, None, args.steps)
    offloader = ActivationOffloader(model, max_fwd_stash_size=args.stash)
    results["checkpointing + offload"] = measure(model, input_ids, offloader, args.steps)
    restore()
    restore = apply_checkpointing(layers, offload=True)
    results["offloaded checkpoints"] = measure(model, input_ids, None, args.steps)
    restore()
    input_ids = input_ids[:, : args.plain_seq_len]
    results["no checkpointing"] = measure(model, input_ids, None, args.steps)
    results["no checkpointing + offload"] = measure(model, input_ids, ActivationOffloader(model), args.steps)

    references = {
        "checkpointing": "checkpointing",
        "checkpointing + offload": "checkpointing",
        "offloaded checkpoints": "checkpointing",
        "no checkpointing": "no checkpointing",
        "no checkpointing + offload": "no checkpointing",
    }
    print(f"{'setting':<28}{'peak GiB':>10}{'above weights':>15}{'step s':>9}{'offloaded GiB':>15}"
          f"{'peak ratio':>12}{'time ratio':>12}{'grad rel diff':>15}")
    for name, result in results.items():
        reference = results[references[name]]
        print(f"{name:<28}{result['peak']:>10.2f}{result['above_weights']:>15.2f}{result['time']:>9.3f}"
              f"{result['offloaded']:>15.2f}{result['peak'] / reference['peak']:>12.3f}"
              f"{result['time'] / reference['time']:>12.3f}"
              f"{max_relative_difference(reference['grads'], result['grads']):>15.2e}")


if __name__ == "__main__":
    main()
