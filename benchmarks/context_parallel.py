"""Benchmark: training-step time of one packed row on 1 rank against 2 context-parallel ranks (CPU, gloo).

The same row (documents with lognormal lengths, packed padding-free) goes through a small Qwen3-shaped model,
forward and backward with the chunked loss: once on one process (``sdpa_by_document`` over the whole row),
then split over 2 ranks with Ulysses (all-to-all of heads around ``sdpa_by_document``) and with ring
(all-gathered keys and values, document-aware). Every rank runs one thread, so cp 2 uses two cores where cp 1
uses one. Rounds alternate between the set-ups; a step's time is the slowest rank's, and the figure is the
median over rounds. The exchange time comes from one extra step under the profiler: the time the ranks spend
inside the collectives (``_c10d_functional`` ops, forward and backward, waits included), as a share of that
profiled step.

Run::

    PYTHONPATH=. python benchmarks/context_parallel.py                 # 8192 tokens, hidden 256, 4 layers
    PYTHONPATH=. python benchmarks/context_parallel.py --tokens 16384
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM

from lit_memtrain.datamodules.padding_free import PaddingFreeCollator
from lit_memtrain.models.presets import build_config
from lit_memtrain.parallel.context_parallel import install_attention, shard_batch
from lit_memtrain.techniques.loss import chunked_cross_entropy

METHODS = ("ulysses", "ring")


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    config = build_config(
        "tiny-qwen3",
        {"hidden_size": args.hidden, "intermediate_size": 3 * args.hidden, "num_hidden_layers": args.layers,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": args.hidden // 4, "vocab_size": 8192},
    )  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa_by_document").train()


def packed_row(tokens: int, vocab_size: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(0)
    lengths, total = [], 0
    while total < tokens:
        length = min(int(torch.empty(1).log_normal_(6.0, 1.0, generator=generator)) + 1, tokens - total)
        lengths.append(length)
        total += length
    examples = [{"input_ids": torch.randint(0, vocab_size, (n,), generator=generator)} for n in lengths]
    return PaddingFreeCollator()(examples)


def one_process_step(model: torch.nn.Module, batch: dict[str, Any]) -> None:
    model.zero_grad(set_to_none=True)
    hidden = model.model(
        input_ids=batch["input_ids"], position_ids=batch["position_ids"], cu_seq_lens_q=batch["cu_seq_lens_q"],
        use_cache=False,
    ).last_hidden_state  # fmt: skip
    shard = shard_batch(batch, 0, 1, "ulysses")  # cp 1: the whole row, targets shifted
    targets = shard.batch["shift_labels"].flatten()
    chunked_cross_entropy(hidden.flatten(0, 1), model.lm_head.weight, targets).backward()


def context_parallel_step(model: torch.nn.Module, shard: Any, group: dist.ProcessGroup) -> None:
    model.zero_grad(set_to_none=True)
    hidden = model.model(
        input_ids=shard.batch["input_ids"], position_ids=shard.batch["position_ids"], use_cache=False
    ).last_hidden_state
    targets = shard.batch["shift_labels"].flatten()
    count = (targets != -100).sum()
    dist.all_reduce(count, group=group)  # the row's trainable targets, over the group
    chunked_cross_entropy(hidden.flatten(0, 1), model.lm_head.weight, targets, count).backward()


def exchange_seconds(profile: torch.profiler.profile) -> float:
    """Time covered by the collectives of a profiled step (nested events counted once)."""
    spans = sorted(
        (event.time_range.start, event.time_range.end)
        for event in profile.events()
        if event.name.startswith("_c10d_functional::")
    )
    covered, reach = 0, None
    for start, end in spans:
        if reach is None or start > reach:
            covered += end - start
            reach = end
        elif end > reach:
            covered += end - reach
            reach = end
    return covered / 1e6


def timed(step, group: dist.ProcessGroup) -> float:
    """Wall time of ``step`` on the slowest rank of ``group``."""
    dist.barrier(group)
    start = time.perf_counter()
    step()
    elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
    return elapsed.item()


def profiled(step, group: dist.ProcessGroup) -> tuple[float, float]:
    """Step time and exchange time of one step under the profiler, each the slowest rank's."""
    dist.barrier(group)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        start = time.perf_counter()
        step()
        elapsed = time.perf_counter() - start
    figures = torch.tensor([elapsed, exchange_seconds(profile)], dtype=torch.float64)
    dist.all_reduce(figures, op=dist.ReduceOp.MAX, group=group)
    return figures[0].item(), figures[1].item()


def worker(rank: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    group, solo = dist.group.WORLD, dist.new_group([0])
    model = build_model(args)
    batch = packed_row(args.tokens, model.config.vocab_size)
    shards = {method: shard_batch(batch, rank, 2, method) for method in METHODS}
    setups = {"cp 1": None, **{f"cp 2 {method}": method for method in METHODS}}
    seconds: dict[str, list[float]] = {name: [] for name in setups}
    exchange: dict[str, tuple[float, float]] = {}
    for round_index in range(args.rounds + 1):  # round 0 warms up and is profiled
        for name, method in setups.items():
            if method is None:  # one process on the whole row; rank 1 waits
                if rank == 0:
                    step = lambda: one_process_step(model, batch)  # noqa: E731
                    if round_index:
                        seconds[name].append(timed(step, solo))
                    else:
                        step()
                dist.barrier(group)
                continue
            attention = install_attention(model, group, method)
            attention.set_layout(shards[method].layout)
            step = lambda method=method: context_parallel_step(model, shards[method], group)  # noqa: E731
            if round_index:
                seconds[name].append(timed(step, group))
            else:
                step()
                exchange[name] = profiled(step, group)
            attention.uninstall()
    if rank == 0:
        report(args, batch, seconds, exchange)
    dist.destroy_process_group()


def report(args: argparse.Namespace, batch: dict[str, Any], seconds: dict[str, list[float]],
           exchange: dict[str, tuple[float, float]]) -> None:  # fmt: skip
    documents = len(batch["cu_seq_lens_q"]) - 1
    print(f"{args.tokens} tokens in one packed row of {documents} documents; hidden {args.hidden}, {args.layers} "
          f"layers, 4 query / 2 key-value heads; fp32, one thread per rank; median of {args.rounds} rounds")  # fmt: skip
    baseline = statistics.median(seconds["cp 1"])
    print("| set-up | step s | cp 1 / this | exchange s (profiled step) | exchange share |")
    print("|---|---|---|---|---|")
    for name, values in seconds.items():
        step = statistics.median(values)
        if name in exchange:
            profiled_step, exchanged = exchange[name]
            extra = f"{exchanged:.3f} | {exchanged / profiled_step:.0%}"
        else:
            extra = "- | -"
        print(f"| {name} | {step:.3f} | {baseline / step:.2f}x | {extra} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    mp.spawn(worker, args=(port, args), nprocs=2, join=True)


if __name__ == "__main__":
    main()
