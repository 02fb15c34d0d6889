"""``lit-memtrain plan``: will a ``fit`` configuration fit on a GPU, and how long a sequence fits.

Takes every argument ``lit-memtrain fit`` takes (``--config``, ``--model.*``, ``--data.*``, ``--trainer.*``)
plus the options below, simulates one optimizer step of that configuration on fake tensors (no weights, no
data, no GPU), and prints the peak device memory per rank with its breakdown and phase, the peak host
memory, and whether it fits::

    lit-memtrain plan --config configs/long_context.yaml --gpu-memory 80
    lit-memtrain plan --config configs/long_context.yaml --find-max-length --compare --plot memory_by_length.png --json

Also run as ``python -m lit_memtrain.planner.command --fit-config FILE.json``, with a fit configuration as
LightningCLI parses it (``model``, ``data`` and ``trainer`` sections) written as JSON: how the ``MemoryPlanCheck``
callback plans its live fit (:mod:`lit_memtrain.callbacks.live_fit`), without LightningCLI's parser. With
``--arguments-from-stdin`` it imports what a plan needs, then reads its arguments as one JSON list from a line of
standard input: the callback starts it as early as it can, so that the imports (most of a small plan's time) are done
while the fit is still setting up (an empty line, or the end of the input, ends it with nothing planned).
"""

from __future__ import annotations

import argparse
import atexit
import gc
import json
import sys
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lit_memtrain.planner.report import PlanReport
    from lit_memtrain.planner.settings import PlanSettings

__all__ = ["main"]

_EPILOG = "Every `lit-memtrain fit` argument is accepted as well (--config, --model.*, --data.*, --trainer.*)."


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lit-memtrain plan",
        description="Simulate one training step of a fit configuration on fake tensors and report its peak memory.",
        epilog=_EPILOG,
    )
    parser.add_argument("--gpu-memory", type=float, default=None, metavar="GIB",
                        help="GPU memory per rank in GiB (default: the local GPU's, else 80)")  # fmt: skip
    parser.add_argument("--margin", type=float, default=None,
                        help="fraction of the GPU memory kept free for the CUDA context, kernel workspaces and "
                             "fragmentation (default 0.1)")  # fmt: skip
    parser.add_argument("--find-max-length", action="store_true",
                        help="also find the longest data.max_length that fits")  # fmt: skip
    parser.add_argument("--compare", action="store_true",
                        help="one row per technique added in turn, with its peak and longest length")  # fmt: skip
    parser.add_argument("--plot", metavar="FILE.png", default=None,
                        help="draw peak memory against sequence length per technique (implies --compare)")  # fmt: skip
    parser.add_argument("--context-parallel-size", type=int, default=None, metavar="N",
                        help="split each sequence over N ranks (context parallelism; sets the strategy's "
                             "context_parallel_size; N must divide trainer.devices x trainer.num_nodes)")  # fmt: skip
    parser.add_argument("--context-parallel-method", choices=("ulysses", "ring"), default=None,
                        help="how the ranks of a sequence exchange attention's inputs (default: the strategy's, "
                             "else ulysses)")  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument("--fit-config", metavar="FILE.json", default=None, help=argparse.SUPPRESS)
    return parser


def main(
    argv: list[str] | None = None, read_fit_arguments: Callable[[list[str]], PlanSettings] | None = None
) -> int:
    """Run ``lit-memtrain plan``; returns the exit status (0, or 2 for a configuration it cannot plan).

    ``read_fit_arguments`` turns ``fit`` arguments into settings (the command line's LightningCLI parser,
    :func:`lit_memtrain.cli.plan.read_fit_config`); without it only ``--fit-config`` is accepted.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    _leave_objects_to_the_os_at_exit()
    parser = _parser()
    if any(arg in ("-h", "--help") for arg in argv):
        parser.print_help()
        return 0
    options, fit_args = parser.parse_known_args(argv)
    try:
        report = _plan(options, fit_args, read_fit_arguments)
    except (ValueError, TypeError, OSError, argparse.ArgumentError) as error:
        print(f"lit-memtrain plan: error: {error}", file=sys.stderr)
        return 2
    print(json.dumps(report.to_json(), indent=2) if options.json else report.to_text())
    return 0


def _leave_objects_to_the_os_at_exit() -> None:
    """Freeze every object when the interpreter exits (``gc.freeze``), so its last collection skips them.

    Why: that collection walks every object torch, transformers and Lightning made, 0.9 s of CPU on a 2-core
    machine, a tenth of a plan; by then the plan is printed and its files are closed, and the OS takes the memory
    back whole. Once per process, however many plans ran in it.
    """
    atexit.unregister(gc.freeze)
    atexit.register(gc.freeze)


def _plan(
    options: argparse.Namespace,
    fit_args: list[str],
    read_fit_arguments: Callable[[list[str]], PlanSettings] | None,
) -> PlanReport:
    from lit_memtrain.planner.simulate import stand_in_device

    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' deprecations, once per simulation

    from lit_memtrain.planner.fit_config import settings_from_config
    from lit_memtrain.planner.plan import DEFAULT_MARGIN, Planner, gpu_budget
    from lit_memtrain.planner.report import PlanReport

    if options.fit_config is not None:
        if fit_args:
            raise ValueError(f"--fit-config takes no fit arguments, got {fit_args}.")
        with open(options.fit_config) as file:
            settings = settings_from_config(json.load(file))
    elif read_fit_arguments is None:
        raise ValueError("Give --fit-config FILE.json, or run `lit-memtrain plan` with fit arguments.")
    else:
        settings = read_fit_arguments(fit_args)
    settings = _with_context_parallel(settings, options.context_parallel_size, options.context_parallel_method)
    budget = gpu_budget(options.gpu_memory, DEFAULT_MARGIN if options.margin is None else options.margin)
    planner = Planner(settings, budget)
    compare = bool(options.compare or options.plot)
    # Workers are forked before this process registers the stand-in device (each registers its own), and the
    # device is registered before anything here runs autograd.
    with planner.searches_in_parallel(options.find_max_length, compare):
        stand_in_device()
        report = PlanReport(settings, budget, planner.simulate())
        report.suggestion = planner.suggestion()
        if options.find_max_length:
            report.search = planner.longest_length()
        if compare:
            report.comparison = planner.comparison()
    if options.plot:
        from lit_memtrain.planner.plot import write_plot

        title = f"{report.to_json()['model']}, {settings.precision}, batch {settings.batch_size}: simulated peak per rank"
        write_plot(options.plot, report.comparison, budget, title)
        report.plot = options.plot
    return report


def _with_context_parallel(settings, size: int | None, method: str | None):
    """``settings`` with the context-parallel options of the command line, planned as ``ContextParallelStrategy``
    (FSDP2 over every rank, each sequence split over ``size`` of them)."""
    import dataclasses

    if size is None and method is None:
        return settings
    strategy = settings.strategy
    if strategy.kind == "not_simulated":
        raise ValueError(
            f"--context-parallel-size plans lit_memtrain.strategies.ContextParallelStrategy, but trainer.strategy is "
            f"{strategy.name!r}; leave the strategy unset or use lit_memtrain.strategies.FSDP2Strategy."
        )
    changes = {"kind": "context_parallel"}
    if strategy.kind != "context_parallel" and not strategy.sharded:
        changes["name"] = "ContextParallelStrategy"
    if size is not None:
        changes["context_parallel_size"] = size
    if method is not None:
        changes["context_parallel_method"] = method
    return settings.replace(strategy=dataclasses.replace(strategy, **changes))


def _main_with_arguments_from_stdin() -> int:
    import lit_memtrain.planner.fit_config  # noqa: F401  (the imports are why this mode exists)
    import lit_memtrain.planner.plan  # noqa: F401
    import lit_memtrain.planner.report  # noqa: F401

    line = sys.stdin.readline()
    return main(json.loads(line)) if line.strip() else 0


if __name__ == "__main__":
    sys.exit(_main_with_arguments_from_stdin() if sys.argv[1:] == ["--arguments-from-stdin"] else main())
