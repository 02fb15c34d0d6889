"""GPU check: packed rows with ``sdpa`` against ``sdpa_by_document``, peak memory and step time, side by side.

A Qwen3-4B-shaped model (hidden 2560, 32 heads, 8 KV heads) with a few layers and random bf16 weights runs
forward + chunked loss + backward, with every layer checkpointed, on one packed padding-free row of
``--seq-len`` tokens made of documents with lognormal lengths (median ``--median-doc``). Each attention
implementation is isolated from the other (``results.run_isolated``), on the same weights and row (same
seeds), after a warm-up step; the model is built on the device (built on the CPU in bf16 and moved, it did not
finish its first configuration in the first GPU run's 75 s: bf16 random initialisation on the CPU took 62 s for
the embedding and one layer, 490M parameters, on this project's 2-core machine):

- ``sdpa``: transformers builds a dense ``L x L`` mask for the packed row and SDPA computes every block,
  masked (no flash kernel: it takes no mask);
- ``sdpa_by_document``: SDPA with ``is_causal=True`` once per document (``lit_memtrain/techniques/attention.py``).

Printed per implementation: peak allocated memory above the weights, median step time, and the largest
relative gradient difference against ``sdpa`` (the two must agree). An out-of-memory step is reported as
such. Checked (exit status 1 when one fails, for ``check.py``): the gradients agree, and on a GPU
``sdpa_by_document`` peaks lower than ``sdpa``. Needs only torch, transformers and numpy.

Run from the repository root (about a minute on one H200)::

    PYTHONPATH=. python benchmarks/gpu/packed_attention.py
    PYTHONPATH=. python benchmarks/gpu/packed_attention.py --seq-len 65536
    PYTHONPATH=. python benchmarks/gpu/packed_attention.py --device cpu --preset tiny-qwen3 --seq-len 512  # smoke run
    PYTHONPATH=. python benchmarks/gpu/packed_attention.py --dry-run  # the same smoke run, 2 layers, 1 step
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from lit_memtrain.techniques.attention import SDPA_BY_DOCUMENT
from lit_memtrain.techniques.checkpointing import apply_checkpointing
from lit_memtrain.datamodules.padding_free import PaddingFreeCollator
from lit_memtrain.models.layers import find_decoder_layers
from lit_memtrain.techniques.loss import chunked_cross_entropy
from lit_memtrain.models.presets import build_config
from results import add_arguments, check, run_isolated, table, watch, write

GIB = 2**30
IMPLEMENTATIONS = ("sdpa", SDPA_BY_DOCUMENT)
# Largest gradient difference, relative to the largest gradient, between the two implementations: bf16 kernels
# that differ (a masked dense one and flash per document) on a GPU, float32 on the CPU.
GRADIENT_TOLERANCE = {"cuda": 5e-2, "cpu": 1e-4}


def packed_row(seq_len: int, median_doc: int, vocab_size: int, device: torch.device) -> dict[str, torch.Tensor]:
    """One padding-free row of documents with lognormal lengths, cut to exactly ``seq_len`` tokens."""
    rng = np.random.default_rng(0)
    lengths = np.clip(np.rint(rng.lognormal(np.log(median_doc), 1.0, seq_len)), 2, seq_len).astype(int)
    lengths = lengths[: int(np.searchsorted(np.cumsum(lengths), seq_len)) + 1]
    lengths[-1] -= int(lengths.sum()) - seq_len
    generator = torch.Generator().manual_seed(0)
    documents = [{"input_ids": torch.randint(0, vocab_size, (int(n),), generator=generator)} for n in lengths if n]
    batch = PaddingFreeCollator()(documents)
    return {key: value.to(device) for key, value in batch.items() if key in ("input_ids", "position_ids", "labels")} | {
        "cu_seq_lens_q": batch["cu_seq_lens_q"]
    }


def step(model: torch.nn.Module, batch: dict[str, torch.Tensor], attention: str) -> None:
    inputs = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"], "use_cache": False}
    if attention == SDPA_BY_DOCUMENT:
        inputs["cu_seq_lens_q"] = batch["cu_seq_lens_q"]  # on the CPU, as CausalLMModule passes it
    hidden = model.model(**inputs).last_hidden_state.flatten(0, 1)
    targets = torch.nn.functional.pad(batch["labels"][0, 1:], (0, 1), value=-100)
    chunked_cross_entropy(hidden, model.lm_head.weight, targets, chunk_size=4096).backward()


def measure(args: argparse.Namespace, attention: str) -> dict[str, object]:
    """One attention implementation; the gradient compared comes back on the CPU."""
    device = torch.device(args.device)
    batch = packed_row(args.seq_len, args.median_doc, build_config(args.preset).vocab_size, device)
    torch.manual_seed(0)
    config = build_config(args.preset, {"num_hidden_layers": args.layers})
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=args.dtype, attn_implementation=attention)
    watch(model)
    apply_checkpointing(find_decoder_layers(model))
    cuda = device.type == "cuda"
    try:
        step(model, batch, attention)  # warm-up
        model.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        held = torch.cuda.memory_allocated() if cuda else 0
        seconds = []
        for _ in range(args.steps):
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            step(model, batch, attention)
            if cuda:
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - start)
        peak = (torch.cuda.max_memory_allocated() - held) / GIB if cuda else float("nan")
        gradient = model.model.layers[0].self_attn.q_proj.weight.grad.to("cpu", torch.float32)
        return {"peak": peak, "seconds": statistics.median(seconds), "gradient": gradient}
    except torch.OutOfMemoryError:
        return {"peak": float("inf"), "seconds": float("inf"), "gradient": None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=32768)
    parser.add_argument("--median-doc", type=int, default=1000)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--preset", default="qwen3-4b")
    parser.add_argument("--device", default="cuda")
    add_arguments(parser)
    args = parser.parse_args()
    if args.dry_run:
        args.device, args.preset, args.seq_len, args.median_doc = "cpu", "tiny-qwen3", 512, 60
        args.layers, args.steps = 2, 1
    elif args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("benchmarks/gpu/packed_attention.py needs a CUDA GPU and none is available: nothing was measured.")
    device = torch.device(args.device)
    args.dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    vocab_size = build_config(args.preset).vocab_size
    documents = len(packed_row(args.seq_len, args.median_doc, vocab_size, torch.device("cpu"))["cu_seq_lens_q"]) - 1
    print(
        f"{args.preset}, {args.layers} layers, {args.dtype}; one packed row of {args.seq_len:,} tokens, "
        f"{documents} documents; each implementation isolated from the other", flush=True
    )
    results = {attention: run_isolated(measure, args, attention) for attention in IMPLEMENTATIONS}
    reference = results["sdpa"]["gradient"]
    ours, theirs = results[SDPA_BY_DOCUMENT], results["sdpa"]
    rows = []
    print(f"{'attention':>18}  {'peak GiB above weights':>22}  {'step s':>7}  {'grad diff vs sdpa':>17}")
    for attention, result in results.items():
        gradient = result["gradient"]
        if gradient is None:
            print(f"{attention:>18}  {'out of memory':>22}")
            rows.append([attention, "out of memory", None, None, None, None])
            continue
        difference = (
            float((gradient - reference).abs().max() / reference.abs().max()) if reference is not None else float("nan")
        )
        print(f"{attention:>18}  {result['peak']:>22.2f}  {result['seconds']:>7.3f}  {difference:>17.2e}")
        rows.append([attention, result["peak"], result["seconds"], result["peak"] / theirs["peak"],
                     result["seconds"] / theirs["seconds"], difference])
    peak_ratio, time_ratio = theirs["peak"] / ours["peak"], theirs["seconds"] / ours["seconds"]
    print(f"sdpa / sdpa_by_document: peak {peak_ratio:.2f}x, time {time_ratio:.2f}x")

    tolerance = GRADIENT_TOLERANCE[device.type]
    difference = rows[1][-1]
    checks = [check("sdpa_by_document gradients match sdpa", difference is not None and difference <= tolerance,
                    f"largest difference {difference:.2e} of the largest gradient, tolerance {tolerance:.0e}"
                    if difference is not None else "sdpa_by_document ran out of memory")]
    if device.type == "cuda":
        checks.append(check("sdpa_by_document peaks lower than sdpa", ours["peak"] < theirs["peak"],
                            f"{ours['peak']:.2f} GiB against {theirs['peak']:.2f} GiB above the weights"))
    for item in checks:
        print(f"{'passed' if item['passed'] else 'FAILED'}: {item['name']} ({item['detail']})")
    title = (f"{args.preset}, {args.layers} layers, {args.dtype}, checkpointing, chunked loss; one packed row of "
             f"{args.seq_len:,} tokens, {documents} documents (median {args.median_doc}); median of {args.steps} "
             "steps; ratios against sdpa in the same run")
    columns = ["attention", "peak GiB above weights", "step s", "peak ratio", "time ratio", "grad diff vs sdpa"]
    summary = f"sdpa / sdpa_by_document: peak {peak_ratio:.2f}x, time {time_ratio:.2f}x"
    config = {key: str(value) for key, value in vars(args).items()} | {"documents": documents}
    passed = write(args.json, summary=summary, tables=[table(title, columns, rows)], checks=checks, config=config)
    sys.exit(0 if passed else 1)


if __name__ == "__main__":
    main()
