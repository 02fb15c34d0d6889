"""Benchmark: a training step with every decoder layer compiled (``CompiledLayers``' technique, inductor) against
the eager step, side by side, on the CPU.

Two copies of one model (Qwen3-0.6B width by default: hidden 1024, MLP 3072, 16 query and 8 key/value heads of
128; a few layers; fp32 on the CPU) run forward, loss and backward on the same packed padding-free rows of
documents of random lengths, with ``sdpa_by_document`` attention (which stays eager inside the compiled layers).
The compiled copy is warmed up first (its compilation, and one recompilation once the number of documents
changes, are reported apart); then rounds alternate which copy goes first, and the figure is the median over
rounds of eager / compiled process CPU time per step. Checked: the losses of every timed step agree within
1e-4 relative (inductor fuses and reorders fp32 arithmetic).

What it says and what it does not: the CPU runs the same fusion of elementwise work (RMSNorm, RoPE, SiLU x up,
residuals) that the GPU check's "step profile compiled" part measures on a GPU, where eager launches those
kernels one by one; the CPU ratio is not the GPU's.

Run::

    python benchmarks/compiled_layers.py                       # 4 layers, rows of 2048 tokens, 3 rounds
    python benchmarks/compiled_layers.py --layers 2 --tokens 1024 --rounds 5
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from transformers import AutoModelForCausalLM

import lit_memtrain  # noqa: F401 - registers sdpa_by_document
from lit_memtrain.datamodules.padding_free import PaddingFreeCollator
from lit_memtrain.models.layers import find_decoder_layers
from lit_memtrain.models.presets import build_config
from lit_memtrain.techniques.compiled_layers import compile_layers
from lit_memtrain.techniques.loss import chunked_cross_entropy


def packed_row(tokens: int, generator: torch.Generator, vocab: int) -> dict:
    lengths, left = [], tokens
    while left:
        n = min(left, int(torch.randint(50, 400, (1,), generator=generator)))
        lengths.append(n)
        left -= n
    documents = [{"input_ids": ids, "labels": ids} for ids in (torch.randint(0, vocab, (n,), generator=generator)
                                                                  for n in lengths)]  # fmt: skip
    return PaddingFreeCollator()(documents)


def step(model, row) -> float:
    hidden = model.get_decoder()(input_ids=row["input_ids"], position_ids=row["position_ids"],
                                 cu_seq_lens_q=row["cu_seq_lens_q"], use_cache=False).last_hidden_state  # fmt: skip
    loss = chunked_cross_entropy(hidden.flatten(0, 1), model.get_output_embeddings().weight, row["labels"].flatten())
    loss.backward()
    model.zero_grad(set_to_none=True)
    return float(loss.detach())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen3-0.6b")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=8192, help="a smaller vocabulary: the head is not compiled")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per copy and round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    config = build_config(args.preset, {"num_hidden_layers": args.layers, "vocab_size": args.vocab})
    eager = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa_by_document").train()
    compiled = copy.deepcopy(eager)
    restore = compile_layers(find_decoder_layers(compiled))
    generator = torch.Generator().manual_seed(1)
    rows = [packed_row(args.tokens, generator, args.vocab) for _ in range(2 + args.steps)]
    for index, row in enumerate(rows[:2]):  # the compilation, then the recompilation for a new document count
        start = time.process_time()
        step(compiled, row)
        print(f"warm-up step {index} of the compiled copy: {time.process_time() - start:.1f} s CPU", flush=True)
    step(eager, rows[0])
    ratios, worst = [], 0.0
    for round_index in range(args.rounds):
        order = (eager, compiled) if round_index % 2 == 0 else (compiled, eager)
        seconds, losses = {}, {}
        for model in order:
            start = time.process_time()
            losses[id(model)] = [step(model, row) for row in rows[2:]]
            seconds[id(model)] = (time.process_time() - start) / args.steps
        worst = max(worst, *(abs(a - b) / abs(a) for a, b in zip(losses[id(eager)], losses[id(compiled)])))
        ratios.append(seconds[id(eager)] / seconds[id(compiled)])
        print(f"round {round_index}: eager {seconds[id(eager)]:.3f} s, compiled {seconds[id(compiled)]:.3f} s per step "
              f"(eager / compiled {ratios[-1]:.2f})", flush=True)
    restore()
    print(f"{args.preset} width, {args.layers} layers, {args.tokens}-token packed rows, fp32 CPU, {torch.get_num_threads()} "
          f"threads: eager / compiled {statistics.median(ratios):.2f}x (median of {args.rounds} rounds); largest "
          f"relative loss difference {worst:.1e}")
    if worst > 1e-4:
        raise SystemExit(f"the compiled losses differ from the eager ones by {worst:.1e} relative, over 1e-4")


if __name__ == "__main__":
    main()
