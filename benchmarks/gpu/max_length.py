"""GPU check part: the longest sequence that fits under a memory cap, per memory technique, measured and planned.

For Qwen3-4B width with ``--layers`` decoder layers (random bf16 weights, bf16-true, one row per step, AdamW),
each row of ``lit-memtrain plan --compare`` in turn (by default: none; + checkpointing; + chunked loss; + tiled
MLP; + offloaded checkpoints: each adds its technique to the row above, as the planner's
:func:`~lit_memtrain.planner.techniques.comparison_rows` builds them) gets two answers side by side:

- planned: :meth:`~lit_memtrain.planner.plan.Planner.longest_length` against a budget of ``--cap-gib`` with no
  margin (what ``plan --find-max-length --compare --gpu-memory CAP --margin 0`` prints), all rows searched at once
  in the planner's worker processes, in a fresh process before any probe (the planner registers its stand-in
  device in the process it runs in);
- measured: ``Trainer.fit`` of :class:`~lit_memtrain.objectives.causal_lm.CausalLMModule` with the row's real
  callbacks (``CallbackSpec.instantiate``) and ``loss_type``, a warm-up step of 1,024 tokens (it creates the AdamW
  state), then one step of the probed length, capped at ``--cap-gib`` by
  ``torch.cuda.set_per_process_memory_fraction`` (expandable segments on): an out-of-memory error means it does
  not fit. A bounded search, not a bisection: the first probe is the planner's length, the second 5% above it
  (if it fit) or below (if not), a third 10% away if the second went the same way; a row stops once bracketed.
  Rows take turns (every row's first probe before any row's second), each probe isolated from the others
  (``run_isolated``: in this process once proven clean, the allocator's cache emptied and the cap lifted between
  probes); after ``--time-budget-s`` only rows not yet probed are (the dry run: one probe).

The table: planned length, the longest measured length that fit and the shortest that did not, measured /
planned, and at the planned length the planner's peak against the peak allocated there (if it fit). The reserved
memory is what the cap limits, the planner predicts the allocated: a planned length that does not fit by a few
percent is the allocator's share (``plan``'s default margin is 10%). Checked: every row's planned length is
within 10% of the measured boundary, where a row was bracketed.

Run from the repository root (about 100 s on one H200, 130 at most)::

    PYTHONPATH=. python benchmarks/gpu/max_length.py
    PYTHONPATH=. python benchmarks/gpu/max_length.py --dry-run   # tiny model on the CPU, nothing is capped
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import Any

from results import add_arguments, check, run_isolated, table, write

from lit_memtrain.techniques.allocator import ALLOC_CONF_VARIABLES, EXPANDABLE_SEGMENTS

# Read once, when CUDA starts: before the first probe (and the libraries' floor run_isolated makes before it). Both
# names, whatever the machine set: torch 2.10 and later read PYTORCH_ALLOC_CONF first, so setting only the old name
# would leave a value set there in force.
os.environ.update(dict.fromkeys(ALLOC_CONF_VARIABLES, EXPANDABLE_SEGMENTS))

GIB = 2**30
ROWS = ("plain", "+ checkpointing", "+ chunked loss", "+ tiled MLP", "+ offloaded checkpoints")
GRANULARITY = 1024
WARMUP_TOKENS = 1024


def fit_config(setup: dict[str, Any]) -> dict[str, Any]:
    """The fit's arguments as ``lit-memtrain fit`` / ``plan`` read them; the techniques come from each row."""
    return {
        "model": {"preset": setup["preset"], "config_overrides": {"num_hidden_layers": setup["layers"]},
                  "dtype": setup["dtype"], "loss_type": "nll"},  # fmt: skip
        "data": {"max_length": setup["start"], "batch_size": 1},
        "trainer": {"precision": setup["precision"]},
    }


def _row_settings(setup: dict[str, Any]) -> dict[str, Any]:
    """The plan settings of each row of :data:`ROWS` asked for, by name."""
    from lit_memtrain.planner.fit_config import settings_from_config
    from lit_memtrain.planner.techniques import comparison_rows, with_techniques

    settings = settings_from_config(fit_config(setup))
    rows = {name: techniques for name, techniques, _ in comparison_rows(settings) if techniques is not None}
    missing = [name for name in setup["rows"] if name not in rows]
    if missing:
        raise ValueError(f"No --compare row named {missing}; the planner's rows here: {list(rows)}.")
    return {name: (settings, rows[name], with_techniques(settings, rows[name])) for name in setup["rows"]}


def plan_rows(setup: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per row: the planner's longest length under the cap (no margin), and its techniques in words."""
    from lit_memtrain.planner.plan import Budget, Planner

    rows = _row_settings(setup)
    settings = next(iter(rows.values()))[0]
    planner = Planner(settings, Budget(int(setup["cap_gib"] * GIB), margin=0.0), progress=lambda line: None)
    planned = {}
    # Every --compare row searched at once in the planner's workers, one per core (on a GPU machine's 16); the dry
    # run's two tiny rows one after the other, faster than starting workers for all of them on a small machine.
    with planner.searches_in_parallel(find_max_length=False, compare=setup["device"] == "cuda"):
        for name, (_, techniques, _) in rows.items():
            search = planner.longest_length(techniques)
            planned[name] = {"length": search.max_length, "peak_gib": search.peaks.get(search.max_length, 0) / GIB,
                             "techniques": techniques.describe()}  # fmt: skip
    return planned


def probe(setup: dict[str, Any], name: str, length: int) -> dict[str, Any]:
    """One step of ``length`` tokens with row ``name``'s techniques under the cap (after a warm-up step): whether it
    fit, and its peaks. The cap is the process's: ``run_isolated`` lifts it again after the probe; expandable
    segments are set before CUDA starts, for every probe alike."""
    import torch
    from lightning.pytorch import Trainer
    from torch.utils.data import DataLoader

    from lit_memtrain.objectives.causal_lm import CausalLMModule

    _, _, settings = _row_settings(setup)[name]
    cuda = setup["device"] == "cuda"
    if cuda:
        torch.cuda.set_per_process_memory_fraction(setup["cap_gib"] * GIB / torch.cuda.get_device_properties(0).total_memory)
    torch.manual_seed(0)
    lengths = (WARMUP_TOKENS, length)  # token ids below 100: in any vocabulary
    batches = [{"input_ids": ids, "labels": ids} for ids in (torch.randint(0, 100, (1, n)) for n in lengths)]
    module = CausalLMModule(**settings.module)
    callbacks = [spec.instantiate() for spec in settings.callbacks]
    trainer = Trainer(
        accelerator="gpu" if cuda else "cpu", devices=1, max_steps=2, precision=setup["precision"], logger=False,
        callbacks=callbacks, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, num_sanity_val_steps=0,
    )  # fmt: skip
    start = time.perf_counter()
    try:
        trainer.fit(module, DataLoader(batches, batch_size=None))
        fits = True
    except torch.OutOfMemoryError:
        fits = False
    return {
        "fits": fits, "seconds": time.perf_counter() - start,
        "peak_gib": torch.cuda.max_memory_allocated() / GIB if cuda else math.nan,
        "reserved_gib": torch.cuda.max_memory_reserved() / GIB if cuda else math.nan,
    }  # fmt: skip


def _round_length(length: float) -> int:
    return max(GRANULARITY, int(round(length / GRANULARITY)) * GRANULARITY)


def next_probe(planned: int, probes: dict[int, bool]) -> int | None:
    """The next length to probe for a row: the planner's, then 5% past it in the direction its outcome points,
    then 10%; ``None`` once a fitting and a failing length are known, or after three probes."""
    if not probes:
        return planned
    fits, fails = [n for n, ok in probes.items() if ok], [n for n, ok in probes.items() if not ok]
    if (fits and fails) or len(probes) >= 3:
        return None
    step = 0.05 * len(probes)
    return _round_length(planned * (1 + step if fits else 1 - step))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen3-4b")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--cap-gib", type=float, default=24.0, help="GPU memory each probe may use")
    parser.add_argument("--rows", nargs="+", default=list(ROWS), help="rows of plan --compare, by name")
    parser.add_argument("--time-budget-s", type=float, default=90.0, help="no second probe starts after this")
    parser.add_argument("--probe-timeout-s", type=float, default=30.0, help="a probe's own limit")
    parser.add_argument("--tolerance", type=float, default=0.10, help="largest |planned / measured length - 1|")
    add_arguments(parser)
    args = parser.parse_args()
    start = time.monotonic()
    device, precision, dtype = "cuda", "bf16-true", "bfloat16"
    if args.dry_run:
        args.preset, args.layers, args.cap_gib, args.rows, args.time_budget_s = "tiny-qwen3", 2, 0.02, args.rows[2:3], 0
        device, precision, dtype = "cpu", "32-true", "float32"
    else:
        import torch

        if not torch.cuda.is_available():
            sys.exit("benchmarks/gpu/max_length.py needs a CUDA GPU and none is available: nothing was measured.")
    setup = {"preset": args.preset, "layers": args.layers, "cap_gib": args.cap_gib, "rows": args.rows,
             "device": device, "precision": precision, "dtype": dtype, "start": 8192 if not args.dry_run else 1024}
    print(f"{args.preset} width, {args.layers} layers, {precision}, cap {args.cap_gib} GiB; planning "
          f"{len(args.rows)} rows", flush=True)  # fmt: skip
    planned = run_isolated(plan_rows, setup, timeout_s=120, fresh=True)  # the planner's stand-in device
    print(f"planned in {time.monotonic() - start:.0f} s: " + ", ".join(f"{n} {p['length']:,}" for n, p in planned.items()),
          flush=True)  # fmt: skip
    probes: dict[str, dict[int, dict[str, Any]]] = {name: {} for name in args.rows}
    pending = True
    while pending:  # rounds over the rows (each row's first probe before any row's second); none after the budget
        pending = False
        for name in args.rows:
            length = next_probe(planned[name]["length"], {n: r["fits"] for n, r in probes[name].items()})
            if length is None or (probes[name] and time.monotonic() - start > args.time_budget_s):
                continue
            probes[name][length] = result = run_isolated(probe, setup, name, length, timeout_s=args.probe_timeout_s)
            pending = True
            print(f"[{time.monotonic() - start:.0f} s] {name}: {length:,} tokens "
                  f"{'fits' if result['fits'] else 'does not fit'} (peak {result['peak_gib']:.2f} GiB, reserved "
                  f"{result['reserved_gib']:.2f}, {result['seconds']:.1f} s)", flush=True)  # fmt: skip
    rows, checks = [], []
    for name in args.rows:
        plan_length = planned[name]["length"]
        fits = [n for n, r in probes[name].items() if r["fits"]]
        fails = [n for n, r in probes[name].items() if not r["fits"]]
        longest, shortest_fail = max(fits, default=None), min(fails, default=None)
        at_plan = probes[name].get(plan_length, {})
        peak = at_plan["peak_gib"] if at_plan.get("fits") else math.nan  # an out-of-memory run's peak says little
        rows.append([name, planned[name]["techniques"], plan_length, longest, shortest_fail,
                     longest / plan_length if longest else math.nan, planned[name]["peak_gib"], peak,
                     peak / planned[name]["peak_gib"], len(probes[name])])  # fmt: skip
        if not args.dry_run and (len(probes[name]) == 3 or (longest and shortest_fail)):
            # The boundary lies between the longest fit and the shortest failure (either may be unknown).
            low, high = (longest or 0) * (1 - args.tolerance), (shortest_fail or math.inf) * (1 + args.tolerance)
            checks.append(check(f"{name}: planned longest length within {args.tolerance:.0%} of the measured",
                                bool(longest and shortest_fail) and low <= plan_length <= high,
                                f"planned {plan_length:,}; fit at {longest or 'none'}, not at {shortest_fail or 'none'}"))
    columns = ["row", "techniques", "planned longest", "measured: longest that fit", "measured: shortest that did not",
               "longest fit / planned", "planned peak GiB at planned length", "measured peak GiB there (if it fit)",
               "peak measured / planned",
               "probes"]  # fmt: skip
    title = (f"{args.preset} width, {args.layers} layers, {precision}, AdamW, one row per step, under a cap of "
             f"{args.cap_gib} GiB (planner: no margin); lengths in tokens")  # fmt: skip
    summary = "; ".join(f"{row[0]}: planned {row[2]:,}, fit {row[3] or 0:,}" for row in rows)
    passed = write(args.json, summary=summary, tables=[table(title, columns, rows)], checks=checks,
                   config=setup | {"planned": planned})  # fmt: skip
    for item in checks:
        print(f"{'passed' if item['passed'] else 'FAILED'}: {item['name']} ({item['detail']})")
    sys.exit(0 if passed else 1)


if __name__ == "__main__":
    main()
