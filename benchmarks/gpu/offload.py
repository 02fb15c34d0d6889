"""GPU check: activation offloading, peak memory and step time, side by side in one run.

A Qwen3-4B-shaped model (hidden 2560, MLP 9728, vocabulary 151,936) with fewer layers and random bf16
weights runs forward + chunked loss + backward on one sequence. Each setting is measured after a warm-up
step, isolated from the others (``results.run_isolated``: nothing an earlier setting left is measured), on the
same weights and tokens (same seeds):

- ``checkpointing``: non-reentrant checkpointing of every layer (the reference for the next two);
- ``checkpointing + offload``: the same with :class:`lit_memtrain.techniques.offload.ActivationOffloader`;
- ``offloaded checkpoints``: checkpointing with each layer's input held by ``save_on_cpu``;
- ``no checkpointing`` and ``no checkpointing + offload``: every activation of the layers offloaded.

Printed per setting: peak allocated memory (``torch.cuda.max_memory_allocated``), the part of it above the
memory held before the step (weights), median step time, bytes offloaded, and ratios against the
reference; plus the largest relative gradient difference against the reference (offloading must not change
the gradients; the last eight parameters' gradients come back to this process in host memory, compared there).
Checked (exit status 1 when one fails, for ``check.py``): the gradients agree; on a GPU, offloaded checkpoints
and offloading without checkpointing lower the peak, and the allocator runs with expandable segments. Needs
only torch and transformers.

Run from the repository root (about 1-2 minutes on one H200)::

    PYTHONPATH=. python benchmarks/gpu/offload.py
    PYTHONPATH=. python benchmarks/gpu/offload.py --seq-len 65536 --layers 8
    PYTHONPATH=. python benchmarks/gpu/offload.py --dry-run  # tiny model on the CPU, host copies included
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from typing import Any

from lit_memtrain.techniques.allocator import enable_expandable_segments

enable_expandable_segments()

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from lit_memtrain.techniques.checkpointing import apply_checkpointing  # noqa: E402
from lit_memtrain.models.layers import find_decoder_layers  # noqa: E402
from lit_memtrain.techniques.loss import chunked_cross_entropy  # noqa: E402
from lit_memtrain.techniques.offload import ActivationOffloader  # noqa: E402
from lit_memtrain.models.presets import build_config  # noqa: E402
from results import add_arguments, check, run_isolated, table, watch, write  # noqa: E402

GIB = 2**30
# Offloading copies tensors and back: gradients differ only by the GPU's non-deterministic kernels (bf16).
GRADIENT_TOLERANCE = {"cuda": 1e-2, "cpu": 1e-6}
# Each setting and the one it is compared with (measured first).
REFERENCES = {
    "checkpointing": "checkpointing",
    "checkpointing + offload": "checkpointing",
    "offloaded checkpoints": "checkpointing",
    "no checkpointing": "no checkpointing",
    "no checkpointing + offload": "no checkpointing",
}


def build_model(preset: str, layers: int, device: torch.device) -> torch.nn.Module:
    config = build_config(preset, {"num_hidden_layers": layers})
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.train()
    return model


def offloader_for(model: torch.nn.Module, **kwargs) -> ActivationOffloader:
    """On the CPU (dry run) the host copies are made anyway, so the whole offloading path runs."""
    on_cpu = next(model.parameters()).device.type == "cpu"
    return ActivationOffloader(model, offload_cpu_tensors_for_testing=on_cpu, **kwargs)


def expandable_segments_in_use() -> bool | None:
    """Whether every segment of the caching allocator is expandable; ``None`` if torch does not say."""
    segments = torch.cuda.memory_snapshot()
    if not segments or "is_expandable" not in segments[0]:
        return None
    return all(segment["is_expandable"] for segment in segments)


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


def measure(model, input_ids, offloader, steps: int) -> dict[str, Any]:
    cuda = input_ids.is_cuda
    step(model, input_ids, offloader)  # warm-up: kernels, pinned-memory cache, allocator segments
    times, peaks, above = [], [], []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        step(model, input_ids, offloader)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        peaks.append(torch.cuda.max_memory_allocated() if cuda else math.nan)
        above.append(peaks[-1] - before if cuda else math.nan)
    return {
        "peak": max(peaks) / GIB,
        "above_weights": max(above) / GIB,
        "time": statistics.median(times),
        "offloaded": (offloader.stats.bytes / GIB) if offloader is not None else 0.0,
        "grads": [p.grad.to("cpu") for p in model.parameters() if p.grad is not None][-8:],
        "expandable_segments": expandable_segments_in_use() if cuda else None,
    }


def measure_setting(setting: str, preset: str, layers: int, seq_len: int, steps: int, stash: int) -> dict[str, Any]:
    """One setting of :data:`REFERENCES` (on the CPU for the dry run's tiny preset)."""
    device = torch.device("cpu" if preset.startswith("tiny") else "cuda")
    model = build_model(preset, layers, device)
    watch(model)
    generator = torch.Generator(device).manual_seed(1)
    input_ids = torch.randint(0, model.config.vocab_size, (1, seq_len), device=device, generator=generator)
    if setting.startswith("checkpointing") or setting == "offloaded checkpoints":
        apply_checkpointing(find_decoder_layers(model), offload=setting == "offloaded checkpoints")
    offloader = None
    if setting == "checkpointing + offload":
        offloader = offloader_for(model, max_fwd_stash_size=stash)
    elif setting == "no checkpointing + offload":
        offloader = offloader_for(model)
    return measure(model, input_ids, offloader, steps) | {"dtype": str(model.dtype)}


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
    add_arguments(parser)
    args = parser.parse_args()
    preset, device = "qwen3-4b", torch.device("cuda")
    if args.dry_run:
        preset, device = "tiny-qwen3", torch.device("cpu")
        args.seq_len, args.plain_seq_len, args.layers, args.steps = 256, 128, 2, 1
    elif not torch.cuda.is_available():
        sys.exit("benchmarks/gpu/offload.py needs a CUDA GPU and none is available: nothing was measured.")
    name = "CPU (dry run)" if args.dry_run else "CUDA GPU"
    print(f"{name}, torch {torch.__version__}, layers {args.layers}, {preset} width, "
          f"chunked loss; {args.seq_len} tokens with checkpointing, {args.plain_seq_len} without; "
          "each setting isolated from the others", flush=True)
    results: dict[str, dict] = {}
    reference_grads: dict[str, list[torch.Tensor]] = {}  # host memory, one reference setting's at a time
    for setting, reference in REFERENCES.items():
        tokens = args.plain_seq_len if setting.startswith("no checkpointing") else args.seq_len
        result = run_isolated(measure_setting, setting, preset, args.layers, tokens, args.steps, args.stash)
        grads = [grad.float() for grad in result.pop("grads")]
        if setting == reference:
            reference_grads = {setting: grads}
        result["grad_difference"] = max_relative_difference(reference_grads[reference], grads)
        results[setting] = result
        print(f"{setting}: peak {result['peak']:.2f} GiB, step {result['time']:.3f} s", flush=True)
    del reference_grads, grads

    columns = ["setting", "tokens", "peak GiB", "above weights GiB", "step s", "offloaded GiB", "peak ratio",
               "time ratio", "grad rel diff"]
    rows = []
    for setting, result in results.items():
        reference = results[REFERENCES[setting]]
        tokens = args.plain_seq_len if setting.startswith("no checkpointing") else args.seq_len
        rows.append([
            setting, tokens, result["peak"], result["above_weights"], result["time"], result["offloaded"],
            result["peak"] / reference["peak"], result["time"] / reference["time"],
            result["grad_difference"],
        ])
    print(f"{'setting':<28}{'peak GiB':>10}{'above weights':>15}{'step s':>9}{'offloaded GiB':>15}"
          f"{'peak ratio':>12}{'time ratio':>12}{'grad rel diff':>15}")
    for setting, _, peak, above, seconds, offloaded, peak_ratio, time_ratio, difference in rows:
        print(f"{setting:<28}{peak:>10.2f}{above:>15.2f}{seconds:>9.3f}{offloaded:>15.2f}{peak_ratio:>12.3f}"
              f"{time_ratio:>12.3f}{difference:>15.2e}")

    tolerance = GRADIENT_TOLERANCE[device.type]
    worst = max(row[-1] for row in rows)
    checks = [check("offloading leaves the gradients unchanged", worst <= tolerance,
                    f"largest relative difference {worst:.2e}, tolerance {tolerance:.0e}")]
    for setting in ("checkpointing + offload", "no checkpointing + offload"):
        offloaded = results[setting]["offloaded"] * GIB
        checks.append(check(f"{setting} moved activations to host memory", offloaded > 0, f"{offloaded:,.0f} bytes"))
    if device.type == "cuda":
        for setting, reference in (("offloaded checkpoints", "checkpointing"),
                                   ("no checkpointing + offload", "no checkpointing")):
            ours, theirs = results[setting]["peak"], results[reference]["peak"]
            checks.append(check(f"{setting} peaks lower than {reference}", ours < theirs,
                                f"{ours:.2f} GiB against {theirs:.2f} GiB"))
        in_use = [result["expandable_segments"] for result in results.values()]
        expandable = None if None in in_use else all(in_use)
        checks.append(check("the caching allocator uses expandable segments", expandable is not False,
                            "every segment is expandable" if expandable else
                            "torch does not report it" if expandable is None else "some segments are not expandable"))
    for item in checks:
        print(f"{'passed' if item['passed'] else 'FAILED'}: {item['name']} ({item['detail']})")
    by_setting = {row[0]: row for row in rows}
    summary = (
        f"peak: offloaded checkpoints {by_setting['offloaded checkpoints'][6]:.2f}x of checkpointing, "
        f"offload without checkpointing {by_setting['no checkpointing + offload'][6]:.2f}x of none; "
        f"time {by_setting['offloaded checkpoints'][7]:.2f}x and {by_setting['no checkpointing + offload'][7]:.2f}x"
    )
    title = (f"{preset} width, {args.layers} layers, {results['checkpointing']['dtype']}, chunked loss, median of "
             f"{args.steps} steps, each setting isolated from the others; ratios against the reference setting "
             "(checkpointing, or no checkpointing) in the same run")
    passed = write(args.json, summary=summary, tables=[table(title, columns, rows)], checks=checks, config=vars(args)
                   | {"json": str(args.json), "preset": preset, "device": str(device)})
    sys.exit(0 if passed else 1)


if __name__ == "__main__":
    main()
