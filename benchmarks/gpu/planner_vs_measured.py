"""GPU check: the planner's predicted peak memory against ``torch.cuda.max_memory_allocated``, side by side.

The planner (:func:`lit_memtrain.planner.simulate.simulate_step`) promises the peak device memory of a
training step before anyone rents a GPU. Here each configuration (by default Qwen3-4B width with 4
layers, at 16k, 32k and 64k tokens, chunked loss, every layer checkpointed, with and without offloaded
checkpoints) is first simulated, then run for real with random bf16 weights, the same way the simulation
runs it: parameters, gradients and AdamW state (``foreach=True``) in bf16, the state created by a warm-up
step; then forward through the decoder, chunked loss, backward, optimizer step, ``zero_grad``. Measured
over that second step: ``torch.cuda.max_memory_allocated`` (and the reserved peak, which is what has to
fit), and both peaks above the memory held before the step (weights, optimizer state, inputs).

The simulations run in a child process, on the CPU while this one measures on the GPU: the stand-in device
the simulation registers must precede any backward in its process (see the module docstring of ``simulate``).
Each configuration is isolated from the others (``results.run_isolated``: in this process once proven clean):
measured one after the other in one process without that proof, the first GPU run saw each configuration's
held memory grow by about a set of decoder layers, those of the earlier configurations, kept alive by a
reference cycle until the next full garbage collection.

Checked (exit status 1 when one fails, for ``check.py``): every measured peak is within ``--tolerance``
(10%) of the prediction. The simulation counts allocations at their exact sizes, not kernel workspaces
or allocator rounding, so a measured peak a little above the prediction is expected. Needs only torch
and transformers.

Run from the repository root (under a minute on one H200)::

    PYTHONPATH=. python benchmarks/gpu/planner_vs_measured.py
    PYTHONPATH=. python benchmarks/gpu/planner_vs_measured.py --layers 8 --seq-lens 65536 131072
    PYTHONPATH=. python benchmarks/gpu/planner_vs_measured.py --dry-run  # tiny model on the CPU, no memory figures
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

import torch
from transformers import AutoModelForCausalLM

from lit_memtrain.techniques.checkpointing import apply_checkpointing
from lit_memtrain.models.layers import find_decoder_layers
from lit_memtrain.techniques.loss import chunked_cross_entropy
from lit_memtrain.models.presets import build_config
from results import add_arguments, check, run_isolated, table, watch, write

GIB = 2**30
CHECKPOINTING = ("full", "offload")
# What a step holds before it starts, in the simulation's breakdown (inputs are "other").
HELD_BEFORE_STEP = ("parameters", "buffers", "optimizer_state", "other")


def start_simulation(preset: str, layers: int, configurations: list[tuple[int, str]]) -> subprocess.Popen:
    """Start the predictions for ``(seq_len, checkpointing)`` pairs in a fresh child process, on the CPU, while
    this one measures on the GPU (the child touches no GPU: the measured memory is this process's alone). It gets
    a quarter of the cores at a lower priority: with all of them (torch's default) it would take the cores the
    measuring process launches kernels from, and the step times measured beside it would be the child's too."""
    request = json.dumps({"preset": preset, "layers": layers, "configurations": configurations})
    threads = str(max(1, (os.cpu_count() or 4) // 4))
    return subprocess.Popen([sys.executable, __file__, "--simulate", request], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ, OMP_NUM_THREADS=threads))  # fmt: skip


def simulation_results(process: subprocess.Popen) -> list[dict[str, float]]:
    """The predictions of :func:`start_simulation`, once it ends."""
    stdout, stderr = process.communicate(timeout=600)
    if process.returncode != 0:
        raise RuntimeError(f"The simulation failed:\n{stderr[-4000:]}")
    return json.loads(stdout.strip().splitlines()[-1])


def _simulate_in_this_process(request: str) -> None:
    from lit_memtrain.planner.simulate import simulate_step

    os.nice(10)  # below the measuring process (start_simulation)
    request = json.loads(request)
    config = build_config(request["preset"], {"num_hidden_layers": request["layers"]})
    predictions = []
    for seq_len, checkpointing in request["configurations"]:
        start = time.perf_counter()
        report = simulate_step(config, seq_len, loss="chunked", checkpointing=checkpointing)
        held = sum(report.device_at_peak.get(kind, 0) for kind in HELD_BEFORE_STEP)
        predictions.append({
            "peak": report.device_peak / GIB,
            "above_held": (report.device_peak - held) / GIB,
            "host": report.host_peak / GIB,
            "seconds": time.perf_counter() - start,
        })
    print(json.dumps(predictions))


def measure(preset: str, layers: int, seq_len: int, checkpointing: str, device: str) -> dict[str, float]:
    """Peak memory of the simulated step, run for real (after a warm-up step that creates the AdamW state)."""
    config = build_config(preset, {"num_hidden_layers": layers})
    device = torch.device(device)
    torch.manual_seed(0)
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa").train()
    watch(model)
    apply_checkpointing(find_decoder_layers(model), offload=checkpointing == "offload")
    optimizer = torch.optim.AdamW(model.parameters(), foreach=True)
    input_ids = torch.randint(0, config.vocab_size, (1, seq_len), device=device)
    position_ids = torch.arange(seq_len, device=device).expand(1, seq_len)
    targets = torch.randint(0, config.vocab_size, (1, seq_len), device=device)

    def train_step() -> None:
        hidden = model.get_decoder()(input_ids=input_ids, position_ids=position_ids, use_cache=False).last_hidden_state
        head = model.get_output_embeddings().weight
        chunked_cross_entropy(hidden.flatten(0, 1), head, targets.flatten()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    cuda = device.type == "cuda"
    train_step()
    if cuda:
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    train_step()
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() / GIB if cuda else math.nan
    return {
        "peak": peak,
        "above_held": peak - held / GIB if cuda else math.nan,
        "reserved": torch.cuda.max_memory_reserved() / GIB if cuda else math.nan,
        "seconds": seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen3-4b")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[16384, 32768, 65536])
    parser.add_argument("--tolerance", type=float, default=0.10, help="largest |measured / predicted - 1| allowed")
    parser.add_argument("--simulate", help=argparse.SUPPRESS)  # the child process: print predictions as JSON
    add_arguments(parser)
    args = parser.parse_args()
    if args.simulate is not None:
        _simulate_in_this_process(args.simulate)
        return
    device = torch.device("cuda")
    if args.dry_run:
        args.preset, args.layers, args.seq_lens, device = "tiny-qwen3", 2, [64, 128], torch.device("cpu")
    elif not torch.cuda.is_available():
        sys.exit("benchmarks/gpu/planner_vs_measured.py needs a CUDA GPU and none is available: nothing was measured.")
    configurations = [(seq_len, mode) for seq_len in args.seq_lens for mode in CHECKPOINTING]
    print(f"{args.preset} width, {args.layers} layers, bf16, chunked loss, AdamW; simulating "
          f"{len(configurations)} configurations in a child process while they are measured", flush=True)
    simulation = start_simulation(args.preset, args.layers, configurations)
    measurements = []
    for seq_len, mode in configurations:
        measurements.append(run_isolated(measure, args.preset, args.layers, seq_len, mode, str(device)))
        print(f"measured {seq_len:,} tokens, {mode} checkpointing: {measurements[-1]['peak']:.2f} GiB", flush=True)
    predictions = simulation_results(simulation)
    rows, checks = [], []
    print(f"{'tokens':>8} {'checkpointing':>13} {'predicted GiB':>14} {'measured GiB':>13} {'ratio':>7} "
          f"{'above held: predicted':>22} {'measured':>9} {'reserved GiB':>13}")
    for (seq_len, mode), predicted, measured in zip(configurations, predictions, measurements):
        ratio = measured["peak"] / predicted["peak"]
        rows.append([
            seq_len, mode, predicted["peak"], measured["peak"], ratio, predicted["above_held"],
            measured["above_held"], measured["above_held"] / predicted["above_held"], measured["reserved"],
            predicted["host"], predicted["seconds"], measured["seconds"],
        ])
        print(f"{seq_len:>8} {mode:>13} {predicted['peak']:>14.2f} {measured['peak']:>13.2f} {ratio:>7.3f} "
              f"{predicted['above_held']:>22.2f} {measured['above_held']:>9.2f} {measured['reserved']:>13.2f}",
              flush=True)
        if device.type == "cuda":
            checks.append(check(
                f"{seq_len} tokens, {mode} checkpointing: measured peak within {args.tolerance:.0%} of the prediction",
                abs(ratio - 1) <= args.tolerance, f"measured / predicted {ratio:.3f}",
            ))
    for item in checks:
        print(f"{'passed' if item['passed'] else 'FAILED'}: {item['name']} ({item['detail']})")
    columns = ["tokens", "checkpointing", "predicted GiB", "measured GiB", "measured / predicted",
               "above held: predicted GiB", "above held: measured GiB", "above held: ratio", "reserved GiB",
               "host GiB (predicted)", "simulation s", "step s"]
    title = (f"{args.preset} width, {args.layers} layers, bf16 parameters, gradients and AdamW state, chunked loss; "
             "peak device memory of one step, predicted by the planner and measured in the same run, each "
             "configuration isolated from the others")
    ratios = [row[4] for row in rows]
    summary = f"measured / predicted peak: {min(ratios):.3f} to {max(ratios):.3f} over {len(rows)} configurations"
    passed = write(args.json, summary=summary, tables=[table(title, columns, rows)], checks=checks,
                   config={"preset": args.preset, "layers": args.layers, "seq_lens": args.seq_lens,
                           "device": str(device), "tolerance": args.tolerance})
    sys.exit(0 if passed else 1)


if __name__ == "__main__":
    main()
