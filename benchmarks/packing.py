"""Benchmark: lit-memtrain's ``pack_dataset`` against ``trl.pack_dataset``, every strategy, side by side.

Two length distributions, both as ``datasets.Dataset`` with one ``input_ids`` list column of random ids:

- ``lognormal``: 1,000,000 examples, median 300 tokens, sigma 1, clipped to [1, 16384]; into 2048 and 8192.
- ``bimodal``: 300,000 examples, 70% chat turns (lognormal around 120 tokens, sigma 0.5) and 30% documents
  (lognormal around 1,500 tokens, sigma 0.8, clipped at 65,536: 3% of the examples are longer than a
  row, some twelve times longer); into 4096.

TRL runs with its defaults (``map`` batches of 1,000 rows), best of ``--trl-runs``; ours best of ``--runs``
(warm) and, in a fresh process, the import of our packing module and its first call (cold: compiling the
copy loop included; the package itself, like ``trl``, is imported before the clock starts, both being
needed to run anything), best of ``--cold-runs`` fresh processes, with the package's bytecode written first
as an installed package has it. Cold ratios divide TRL's first call by it. Fill = tokens / (rows x max_length).
Targets: every strategy >= 20x faster than TRL, cold and warm, at a fill >= TRL's. Last, the same data streamed
(``pack_dataset`` of an ``IterableDataset``, ``buffer_size`` 1,000): its fill against the global plan's
(target: within 0.5 points). Before timing, three times the
dataset's token bytes are touched once: on a VM that backs guest memory lazily, the first touch of a page
costs ~10x a normal page fault, and that one-off cost (paid by whichever packer runs first) would
otherwise swamp a sub-second run.

Run (needs trl: ``pip install -e .[bench]``)::

    python benchmarks/packing.py                                  # everything (~10 minutes on 2 cores)
    python benchmarks/packing.py --examples 200000 --skip-cold    # quicker
    python benchmarks/packing.py --examples 300000 --skip-stream  # the figures in docs/benchmarks.md
    python benchmarks/packing.py --stream-only                    # the streamed fill alone
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

import lit_memtrain  # noqa: F401 - the package (torch, lightning) is imported before any clock starts

DISTRIBUTIONS = {"lognormal": (2048, 8192), "bimodal": (4096,)}


def lengths_of(distribution: str, num_examples: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if distribution == "lognormal":
        return np.clip(np.rint(rng.lognormal(np.log(300), 1.0, num_examples)), 1, 16384).astype(np.int64)
    chat = rng.random(num_examples) < 0.7
    lengths = np.where(chat, rng.lognormal(np.log(120), 0.5, num_examples), rng.lognormal(np.log(1500), 0.8, num_examples))
    return np.clip(np.rint(lengths), 1, 65536).astype(np.int64)


def build_dataset(distribution: str, num_examples: int, seed: int) -> datasets.Dataset:
    """A dataset built straight from an Arrow list array (no Python list per example)."""
    lengths = lengths_of(distribution, num_examples, seed)
    offsets = np.zeros(num_examples + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    values = np.random.default_rng(seed + 1).integers(0, 50_000, size=int(offsets[-1]), dtype=np.int32)
    column = pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))
    return datasets.Dataset(pa.table({"input_ids": column}), fingerprint=f"bench-{distribution}-{num_examples}-{seed}")


def compile_package() -> None:
    """Write lit_memtrain's bytecode, as installing a wheel does (``trl`` in site-packages has its own): where
    ``PYTHONDONTWRITEBYTECODE`` is set or the checkout is read-only, every fresh process would otherwise compile
    the packing modules from source (~10 ms under a profiler), a cost no installed package pays."""
    import compileall

    compileall.compile_dir(os.path.dirname(lit_memtrain.__file__), quiet=1)


def touch_memory(dataset: datasets.Dataset) -> None:
    tokens = int(pc.sum(pc.list_value_length(dataset.data.column("input_ids"))).as_py())
    np.ones(3 * 4 * tokens // 8, dtype=np.int64)


def fill(packed: datasets.Dataset, max_length: int) -> tuple[float, int, int]:
    """(fill, rows, tokens) of a packed dataset."""
    tokens = int(pc.sum(pc.list_value_length(packed.data.column("input_ids"))).as_py())
    return tokens / (len(packed) * max_length), len(packed), tokens


def timed(pack, runs: int) -> tuple[list[float], datasets.Dataset]:
    seconds, result = [], None
    for _ in range(runs):
        del result
        start = time.perf_counter()
        result = pack()
        seconds.append(time.perf_counter() - start)
    return seconds, result


def cold(distribution: str, num_examples: int, seed: int, strategy: str, max_length: int) -> float:
    """Seconds to import our packing module and make the first ``pack_dataset`` call, in a fresh process."""
    args = [sys.executable, __file__, "--cold", distribution, strategy, str(max_length), "--seed", str(seed)]
    args += ["--examples" if distribution == "lognormal" else "--bimodal-examples", str(num_examples)]
    out = subprocess.run(args, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["seconds"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=1_000_000, help="lognormal examples")
    parser.add_argument("--bimodal-examples", type=int, default=300_000)
    parser.add_argument("--runs", type=int, default=3, help="warm runs of ours (best is reported)")
    parser.add_argument("--trl-runs", type=int, default=2)
    parser.add_argument("--cold-runs", type=int, default=3, help="fresh processes timing ours cold (best is reported)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-cold", action="store_true")
    parser.add_argument("--stream-only", action="store_true", help="only the streamed fill against the global plan")
    parser.add_argument("--skip-stream", action="store_true", help="leave out the streamed fill")
    parser.add_argument("--buffer-size", type=int, default=1000, help="examples per streamed window")
    parser.add_argument("--cold", nargs=3, metavar=("DISTRIBUTION", "STRATEGY", "MAX_LENGTH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    datasets.disable_progress_bars()
    sizes = {"lognormal": args.examples, "bimodal": args.bimodal_examples}

    if args.cold:  # the child process of cold(): time the very first call
        distribution, strategy, max_length = args.cold[0], args.cold[1], int(args.cold[2])
        dataset = build_dataset(distribution, sizes[distribution], args.seed)
        touch_memory(dataset)
        start = time.perf_counter()
        from lit_memtrain.datamodules.packing import pack_dataset

        pack_dataset(dataset, max_length, strategy)
        print(json.dumps({"seconds": time.perf_counter() - start}))
        return

    if args.stream_only:
        streamed_fill(sizes, args.seed, args.buffer_size)
        return

    import trl

    from lit_memtrain.datamodules.packing import pack_dataset
    from lit_memtrain.datamodules.packing_plan import STRATEGIES

    compile_package()

    print(f"trl {trl.__version__}, datasets {datasets.__version__}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}")
    header = ("data", "max_length", "strategy", "cold s", "warm s", "TRL first s", "TRL best s", "TRL/cold",
              "TRL/warm", "fill ours", "fill TRL", "rows ours", "rows TRL")
    rows = [header]
    for distribution, max_lengths in DISTRIBUTIONS.items():
        dataset = build_dataset(distribution, sizes[distribution], args.seed)
        lengths = pc.list_value_length(dataset.data.column("input_ids")).to_numpy()
        print(f"{distribution}: {len(dataset):,} examples, {int(lengths.sum()):,} tokens, "
              f"{100 * np.mean(lengths > min(max_lengths)):.1f}% longer than {min(max_lengths)}")
        touch_memory(dataset)
        warm_up = dataset.select(range(100))
        for strategy in STRATEGIES:
            pack_dataset(warm_up, 256, strategy)
            trl.pack_dataset(warm_up, 256, strategy)
        for max_length in max_lengths:
            for strategy in STRATEGIES:
                cold_s = float("nan")
                if not args.skip_cold:
                    cold_s = min(
                        cold(distribution, sizes[distribution], args.seed, strategy, max_length)
                        for _ in range(args.cold_runs)
                    )
                ours_s, ours = timed(lambda: pack_dataset(dataset, max_length, strategy), args.runs)
                ours_fill = fill(ours, max_length)
                del ours
                trl_s, theirs = timed(lambda: trl.pack_dataset(dataset, max_length, strategy), args.trl_runs)
                trl_fill = fill(theirs, max_length)
                del theirs
                if ours_fill[2] != trl_fill[2]:
                    raise RuntimeError(f"token counts differ: ours {ours_fill[2]}, trl {trl_fill[2]}")
                rows.append((
                    distribution, str(max_length), strategy, f"{cold_s:.3f}", f"{min(ours_s):.3f}", f"{trl_s[0]:.2f}",
                    f"{min(trl_s):.2f}", f"{trl_s[0] / cold_s:.1f}x" if cold_s == cold_s else "-",
                    f"{min(trl_s) / min(ours_s):.1f}x",
                    f"{100 * ours_fill[0]:.3f}%", f"{100 * trl_fill[0]:.3f}%", f"{ours_fill[1]:,}", f"{trl_fill[1]:,}",
                ))
                print("  ".join(rows[-1]), flush=True)
        del dataset
    widths = [max(len(row[column]) for row in rows) for column in range(len(header))]
    print()
    for row in rows:
        print("  ".join(cell.rjust(width) for cell, width in zip(row, widths)))
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")
    if not args.skip_stream:
        streamed_fill(sizes, args.seed, args.buffer_size)


def streamed_fill(sizes: dict[str, int], seed: int, buffer_size: int) -> None:
    """Fill of the same data packed as a stream, a window of ``buffer_size`` examples at a time, with ``bfd``."""
    from lit_memtrain.datamodules.packing import pack_dataset

    print(f"\nstreamed, buffer_size {buffer_size:,}, bfd:")
    for distribution, max_lengths in DISTRIBUTIONS.items():
        dataset = build_dataset(distribution, sizes[distribution], seed)
        for max_length in max_lengths:
            whole = fill(pack_dataset(dataset, max_length, "bfd"), max_length)
            start = time.perf_counter()
            tokens = rows = 0
            for row in pack_dataset(dataset.to_iterable_dataset(), max_length, "bfd", buffer_size=buffer_size):
                tokens, rows = tokens + len(row["input_ids"]), rows + 1
            seconds = time.perf_counter() - start
            streamed = tokens / (rows * max_length)
            print(f"{distribution} {max_length}: streamed fill {100 * streamed:.3f}% ({rows:,} rows, {seconds:.1f} s), "
                  f"global {100 * whole[0]:.3f}% ({whole[1]:,} rows): {100 * (whole[0] - streamed):.3f} points apart")


if __name__ == "__main__":
    main()
