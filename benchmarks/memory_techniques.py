"""Benchmark: what each memory technique saves (simulated peak device memory) and what it costs (CPU time).

Memory: the simulated peak of one training step (forward, loss, backward, AdamW step) of Qwen3-4B (all 36
layers, bf16 parameters, gradients and AdamW state: Lightning's ``precision="bf16-true"``; one row of L
tokens), each row adding one technique to the previous one:

    plain -> + checkpointing -> + chunked loss -> + tiled MLP -> + offloaded checkpoints

Simulated with :func:`lit_memtrain.planner.simulate.simulate_step` (fake tensors: allocations only, no
kernel workspaces or fragmentation; see that module for what it assumes).

Time: the real CPU time of one training step of a small Qwen3 (hidden 256, MLP 768, 4 layers, vocabulary
8192, 2048 tokens, fp32, one thread) for each technique, relative to the plain step: the price of each
saving. The configurations are timed in turns and the fastest turn of each is reported: on a shared
machine other work only ever adds time. On the CPU an offloaded checkpoint is not copied (it already lives in host
memory): that row's GPU cost, two PCIe copies of one L x H tensor per layer, does not show here.

Run::

    python benchmarks/memory_techniques.py                         # 16k, 64k, 160k, 256k tokens
    python benchmarks/memory_techniques.py --lengths 16384 --layers 4   # quick look
"""

from __future__ import annotations

import argparse
import multiprocessing
import time

import torch
from transformers import AutoModelForCausalLM

from lit_memtrain.techniques.checkpointing import apply_checkpointing
from lit_memtrain.models.layers import find_decoder_layers
from lit_memtrain.techniques.loss import chunked_cross_entropy, cross_entropy
from lit_memtrain.planner.simulate import MemoryReport, simulate_step
from lit_memtrain.models.presets import build_config
from lit_memtrain.techniques.tiled_mlp import apply_tiled_mlp

CUMULATIVE = [
    ("plain", {}),
    ("+ checkpointing", {"checkpointing": "full"}),
    ("+ chunked loss", {"checkpointing": "full", "loss": "chunked"}),
    ("+ tiled MLP", {"checkpointing": "full", "loss": "chunked", "tiled_mlp": True}),
    ("+ offloaded checkpoints", {"checkpointing": "offload", "loss": "chunked", "tiled_mlp": True}),
]
SELECTIVE = ("+ selective checkpointing", {"checkpointing": "selective", "loss": "chunked"})
TIMED = [*CUMULATIVE[:3], SELECTIVE, *CUMULATIVE[3:]]
SMALL_QWEN3 = {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4, "num_attention_heads": 4,
               "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 8192}
GIB = 2**30


def _timed_simulation(layers: int, length: int, options: dict) -> tuple[MemoryReport, float]:
    start = time.perf_counter()
    report = simulate_step(build_config("qwen3-4b", {"num_hidden_layers": layers}), length, **options)
    return report, time.perf_counter() - start


def memory_table(lengths: list[int], layers: int) -> None:
    # A process of its own: the simulation's stand-in accelerator stays there (in this process it would
    # also slow the real CPU steps timed below).
    simulator = multiprocessing.get_context("spawn").Pool(1)
    print(f"\nSimulated peak device memory of one step, Qwen3-4B ({layers} layers, bf16, AdamW), GiB "
          "(ratio to plain; host memory in brackets when used; simulation wall time)")
    print("| technique | " + " | ".join(f"{length // 1024}k tokens" for length in lengths) + " |")
    print("|---|" + "---|" * len(lengths))
    plain: dict[int, int] = {}
    for name, options in CUMULATIVE:
        cells = []
        for length in lengths:
            report, seconds = simulator.apply(_timed_simulation, (layers, length, options))
            plain.setdefault(length, report.device_peak)
            host = f" [host {report.host_peak_gib:.1f}]" if report.host_peak > 2**20 else ""
            cells.append(
                f"{report.device_peak_gib:.1f} ({report.device_peak / plain[length]:.2f}x){host} {seconds:.0f}s"
            )
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
    simulator.close()
    simulator.join()
    print(f"Fixed part (parameters, gradients, AdamW state): {report.fixed / GIB:.1f} GiB")


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, input_ids: torch.Tensor, loss: str) -> None:
    targets = torch.cat([input_ids[:, 1:], torch.full_like(input_ids[:, :1], -100)], dim=1).flatten()
    if loss == "chunked":
        hidden = model.get_decoder()(input_ids=input_ids, use_cache=False).last_hidden_state
        value = chunked_cross_entropy(hidden.flatten(0, 1), model.get_output_embeddings().weight, targets)
    else:
        value = cross_entropy(model(input_ids=input_ids, use_cache=False).logits.flatten(0, 1), targets)
    value.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def time_table(seq_len: int, turns: int) -> None:
    torch.set_num_threads(1)
    config = build_config("qwen3-1.7b", SMALL_QWEN3)
    input_ids = torch.randint(0, config.vocab_size, (1, seq_len), generator=torch.Generator().manual_seed(0))
    runs = []
    for name, options in TIMED:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").train()
        layers = find_decoder_layers(model)
        if "checkpointing" in options:
            apply_checkpointing(
                layers, selective=options["checkpointing"] == "selective", offload=options["checkpointing"] == "offload"
            )
        if options.get("tiled_mlp"):
            apply_tiled_mlp(layers)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
        _step(model, optimizer, input_ids, options.get("loss", "plain"))  # warm-up, creates the AdamW state
        runs.append((name, model, optimizer, options.get("loss", "plain"), []))
    for _ in range(turns):
        for _, model, optimizer, loss, seconds in runs:
            start = time.perf_counter()
            _step(model, optimizer, input_ids, loss)
            seconds.append(time.perf_counter() - start)
    print(f"\nCPU time of one step, small Qwen3 (hidden 256, MLP 768, 4 layers, vocabulary 8192), {seq_len} tokens, "
          f"fp32, 1 thread, fastest of {turns} turns")
    print("| technique | seconds per step | ratio to plain |")
    print("|---|---|---|")
    plain = min(runs[0][4])
    for name, _, _, _, seconds in runs:
        print(f"| {name} | {min(seconds):.3f} | {min(seconds) / plain:.2f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[16384, 65536, 163840, 262144])
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--time-seq-len", type=int, default=2048)
    parser.add_argument("--turns", type=int, default=5)
    args = parser.parse_args()
    time_table(args.time_seq_len, args.turns)
    memory_table(args.lengths, args.layers)


if __name__ == "__main__":
    main()
