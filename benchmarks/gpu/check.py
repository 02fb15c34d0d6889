"""Check every GPU claim of the project in one command, in 8 minutes on one CUDA GPU.

Why: a GPU is lent rarely and briefly (one H200 for about 15 minutes in all, its start included), so the check
must be ready before it is needed, finish well inside that time, and leave something useful however it ends.
Each part of :data:`PARTS` runs in a process of its own (its own process group), with its own time limit inside
one overall budget: a part that hangs is killed at its limit, a crash or a failed check is recorded, and the
next part runs either way. The parts run in the order of what is least known (first what no GPU run has
measured yet), so a budget cut short loses what was confirmed before. After every part, ``report.json`` and
``report.md`` (Markdown tables ready to paste into docs/benchmarks.md, with the GPU, torch, CUDA and package
versions, the date, the command, and how each setting was isolated) are rewritten in the output directory, so a
run cut short still leaves the parts that finished.

A part is a script of this folder that follows ``results.py`` (``--json PATH``, ``--dry-run``); adding
one is one line in :data:`PARTS`. Parts marked ``optional`` are skipped with a message while their script
does not exist yet. A part that fails because a package it imports is missing, and that package is one a
bare GPU machine may lack (``results.OPTIONAL_PACKAGES``), counts as skipped, with the package named.

The runner itself needs only the standard library; versions and the GPU are read in a child process, so
this process never holds a CUDA context. Without CUDA it stops at once (exit status 2) unless
``--dry-run``: every part then runs on the CPU with tiny shapes, which the test suite does.

Run from the repository root (``make gpu-check OUT=gpu-check`` installs the package first)::

    python benchmarks/gpu/check.py gpu-check                   # on a CUDA machine; then read gpu-check/report.md
    python benchmarks/gpu/check.py gpu-check --only planner    # one part again
    python benchmarks/gpu/check.py /tmp/dry --dry-run          # on the CPU, tiny shapes
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from results import missing_optional_package

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent

# Versions recorded in the report (distribution names).
REPORTED_PACKAGES = (
    "transformers", "lightning", "peft", "accelerate", "pytest", "numpy", "matplotlib", "datasets", "wandb",
    "jsonargparse", "flash-attn", "bitsandbytes", "vllm",
)


@dataclass(frozen=True)
class Part:
    """One part of the check: ``python benchmarks/gpu/<script> *args --json PATH [--dry-run]``."""

    name: str
    script: str
    limit_s: int
    args: tuple[str, ...] = ()
    optional: bool = False


# Order: first what no GPU run has measured yet (the step profile, eager then with compiled layers, context
# parallelism, the planner at 64k and 128k, the longest length under a cap, offloading at 36 layers), then what the
# second run confirmed. Limits: on one H200
# on 2026-12-04, with a fresh process per setting, the parts took 40 s (gpu tests) to 110 s for half the planner's
# configurations, 15-25 s a setting of it spawn, imports and CUDA's start; settings now run in the part's own
# process once proven clean (results.run_isolated), which leaves a part's start (imports, CUDA, the libraries'
# floor) and its settings' own time. The limits are estimates from those timings until a GPU run measures them;
# the parts' seconds and each setting's are in the report.
PARTS: tuple[Part, ...] = (
    Part("step profile", "step_profile.py", limit_s=120),
    Part("step profile compiled", "step_profile.py", limit_s=150, args=("--compile",)),
    Part("context parallel", "context_parallel.py", limit_s=70, optional=True),
    Part("planner", "planner_vs_measured.py", limit_s=120,
         args=("--seq-lens", "16384", "32768", "65536", "131072", "--tolerance", "0.05")),
    Part("max length", "max_length.py", limit_s=150, args=("--time-budget-s", "100")),
    Part("offload 36 layers", "offload.py", limit_s=90,
         args=("--layers", "36", "--steps", "2", "--seq-len", "16384", "--plain-seq-len", "2048")),
    Part("offload", "offload.py", limit_s=60, args=("--layers", "4", "--steps", "2")),
    Part("fsdp2", "fsdp2.py", limit_s=60, optional=True),
    Part("gpu tests", "gpu_tests.py", limit_s=60),
    Part("packed attention", "packed_attention.py", limit_s=45),
    Part("grpo vllm", "grpo_vllm.py", limit_s=60),
)
# The 8 minutes, and well inside one 10-minute command on a lent machine.
DEFAULT_BUDGET_S = 480

# A part is not started with less than this many seconds of the budget left (or its own limit, if shorter).
MIN_PART_S = 20

_ENVIRONMENT_PROBE = """
import importlib.metadata, json, platform, sys
info = {"python": platform.python_version()}
try:
    import torch
except ImportError as error:
    print(json.dumps(info | {"error": f"torch cannot be imported: {error}"}))
    sys.exit()
info |= {"torch": torch.__version__, "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
if info["cuda_available"]:
    props = torch.cuda.get_device_properties(0)
    info |= {"gpu": props.name, "gpu_memory_gib": round(props.total_memory / 2**30, 1),
             "gpu_count": torch.cuda.device_count(), "capability": f"{props.major}.{props.minor}"}
packages = {}
for name in sys.argv[1:]:
    try:
        packages[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        packages[name] = None
print(json.dumps(info | {"packages": packages}))
"""


def part_environment() -> dict[str, str]:
    """The parts import this checkout's ``lit_memtrain`` whatever is installed, and see no hub."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("WANDB_MODE", "offline")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def probe_environment() -> dict[str, Any]:
    command = [sys.executable, "-c", _ENVIRONMENT_PROBE, *REPORTED_PACKAGES]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=120, env=part_environment())
    except subprocess.TimeoutExpired:
        return {"error": "reading the torch version and the GPU took more than 120 s"}
    if result.returncode != 0:
        return {"error": f"reading the torch version and the GPU failed: {result.stderr.strip()[-2000:]}"}
    return json.loads(result.stdout.strip().splitlines()[-1])


def _kill_group(process: subprocess.Popen) -> None:
    """Stop the part and everything it started (it leads its own process group)."""
    for sig, wait_s in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def _tail(path: Path, chars: int = 4000) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    return text[-chars:]


def run_part(part: Part, out_dir: Path, limit_s: float, dry_run: bool) -> dict[str, Any]:
    """Run one part with a time limit; return its record for report.json."""
    script = HERE / part.script
    file_name = part.name.replace(" ", "_")  # one part's files; a script may run as several parts
    json_path = out_dir / "parts" / f"{file_name}.json"
    log_path = out_dir / "logs" / f"{file_name}.log"
    command = [sys.executable, str(script), *part.args, "--json", str(json_path)] + (["--dry-run"] if dry_run else [])
    shown = script.relative_to(ROOT) if script.is_relative_to(ROOT) else script
    record: dict[str, Any] = {
        "name": part.name,
        "command": shlex.join(["python", str(shown), *command[2:]]),
        "limit_s": round(limit_s),
        "seconds": 0.0,
        "log": str(log_path.relative_to(out_dir)),
    }
    if not script.exists():
        reason = f"{shown} does not exist yet"
        return record | {"status": "skipped" if part.optional else "failed", "reason": reason}
    json_path.unlink(missing_ok=True)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    with log_path.open("w") as log:
        process = subprocess.Popen(
            command, cwd=ROOT, env=part_environment(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            returncode: int | None = process.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            returncode = None
        finally:
            _kill_group(process)  # also whatever the part left running, and the part itself on an interrupt
    record["seconds"] = round(time.monotonic() - start, 1)
    record["returncode"] = returncode
    output = _tail(log_path)
    record["output_tail"] = output
    unreadable = ""
    if json_path.exists():
        try:
            record["result"] = json.loads(json_path.read_text())
        except json.JSONDecodeError as error:  # stopped while writing it: the report and the next parts go on
            unreadable = f"its results ({json_path.name}) are not JSON: {error}"
    if returncode is None:
        reason = f"killed at its limit of {limit_s:.0f} s" + (f"; {unreadable}" if unreadable else "")
        return record | {"status": "timed out", "reason": reason}
    if unreadable:
        return record | {"status": "failed", "reason": unreadable}
    if returncode == 0:
        return record | {"status": "passed", "reason": ""}
    package = missing_optional_package(output) if "result" not in record else None
    if package is not None:
        return record | {"status": "skipped", "reason": f"needs {package}, which is not installed"}
    failed = [c["name"] for c in record.get("result", {}).get("checks", []) if not c["passed"]]
    reason = f"failed checks: {'; '.join(failed)}" if failed else f"exit status {returncode}"
    return record | {"status": "failed", "reason": reason}


def _cell(value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        if value == 0:
            return "0"
        if not 1e-3 <= abs(value) < 1e6:
            return f"{value:.2e}"
        return f"{value:.3f}" if abs(value) < 10 else f"{value:,.1f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def _markdown_table(columns: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return lines + ["| " + " | ".join(_cell(value) for value in row) + " |" for row in rows]


def settings_line(settings: list[dict[str, Any]], part_s: float) -> str:
    """How a part's settings were isolated and where its time went, in one line."""
    here = [item for item in settings if item["process"] == "this one"]
    fresh = [item for item in settings if item["process"] == "fresh"]
    spent = sum(item["seconds"] for item in settings)
    line = f"Settings: {len(here)} in the part's own process, each proven clean first"
    if fresh:
        reasons = sorted({f"{item['setting']}: {item['detail']}" for item in fresh})
        line += f"; {len(fresh)} in a fresh process ({'; '.join(reasons)})"
    return line + f". {spent:.1f} s in settings of the part's {part_s:.1f} s."


def render_markdown(report: dict[str, Any]) -> str:
    env = report["environment"]
    packages = env.get("packages", {})
    machine = env.get("gpu") or "no GPU (dry run on the CPU: figures mean nothing)"
    if env.get("gpu"):
        machine += f" ({env['gpu_memory_gib']} GiB, compute capability {env['capability']}, {env['gpu_count']} visible)"
    lines = [
        f"# GPU check, {report['date']}",
        "",
        f"- Machine: {machine}",
        f"- torch {env.get('torch', '?')}, CUDA {env.get('cuda') or 'none'}, Python {env.get('python', '?')}",
        "- " + ", ".join(f"{name} {version or 'absent'}" for name, version in packages.items()),
        f"- Command: `{report['command']}` (commit {report.get('commit') or 'unknown'})",
        f"- {report['elapsed_s']:.0f} s in all, budget {report['budget_s']:.0f} s",
        "",
    ]
    summary_rows = [
        [p["name"], f"**{p['status']}**", p["seconds"], p["limit_s"], p.get("result", {}).get("summary") or p["reason"]]
        for p in report["parts"]
    ]
    lines += _markdown_table(["part", "status", "s", "limit s", "summary"], summary_rows)
    for part in report["parts"]:
        lines += ["", f"## {part['name']}: {part['status']}", "", f"`{part['command']}`"]
        if part["reason"]:
            lines += ["", part["reason"]]
        result = part.get("result", {})
        for table in result.get("tables", []):
            lines += ["", f"{table['title']}:", ""] + _markdown_table(table["columns"], table["rows"])
        if result.get("settings"):
            lines += ["", settings_line(result["settings"], part["seconds"])]
        if result.get("checks"):
            lines += ["", "Checks:", ""]
            for item in result["checks"]:
                lines.append(f"- {'passed' if item['passed'] else '**FAILED**'}: {item['name']} ({item['detail']})")
        if part["status"] in ("failed", "timed out") and part.get("output_tail"):
            lines += ["", "Last lines of its output:", "", "```", *part["output_tail"].splitlines()[-25:], "```"]
    return "\n".join(lines) + "\n"


def write_report(report: dict[str, Any], out_dir: Path) -> None:
    (out_dir / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    (out_dir / "report.md").write_text(render_markdown(report))


def _commit() -> str | None:
    try:
        command = ["git", "rev-parse", "--short", "HEAD"]
        result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return result.stdout.strip() if result.returncode == 0 else None


def run_check(
    parts: tuple[Part, ...], out_dir: Path, *, budget_s: float, dry_run: bool, environment: dict[str, Any], command: str
) -> dict[str, Any]:
    """Run ``parts`` in order inside ``budget_s`` seconds, rewriting the report after each; return the report."""
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    report: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": command,
        "commit": _commit(),
        "dry_run": dry_run,
        "budget_s": budget_s,
        "elapsed_s": 0.0,
        "environment": environment,
        "parts": [],
    }
    for part in parts:
        elapsed = time.monotonic() - start
        limit_s = min(part.limit_s, budget_s - elapsed)
        if limit_s < min(part.limit_s, MIN_PART_S):
            reason = f"not started: {budget_s - elapsed:.0f} s of the budget left"
            record = {"name": part.name, "status": "skipped", "seconds": 0.0, "limit_s": 0, "command": part.script,
                      "reason": reason}
        else:
            print(f"[{elapsed:6.1f}s] {part.name}: start (limit {limit_s:.0f} s)", flush=True)
            record = run_part(part, out_dir, limit_s, dry_run)
        report["parts"].append(record)
        report["elapsed_s"] = round(time.monotonic() - start, 1)
        write_report(report, out_dir)
        detail = record["reason"] or record.get("result", {}).get("summary", "")
        print(f"[{report['elapsed_s']:6.1f}s] {part.name}: {record['status']} in {record['seconds']:.1f} s"
              + (f" - {detail}" if detail else ""), flush=True)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path, help="directory for report.json, report.md, parts/ and logs/")
    parser.add_argument("--dry-run", action="store_true", help="run every part on the CPU with tiny shapes")
    parser.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S, help="seconds for all parts together")
    parser.add_argument(
        "--only", nargs="+", metavar="PART", choices=[p.name for p in PARTS],
        help="run only these parts, named as in the report (quote names with spaces)",
    )
    args = parser.parse_args(argv)

    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # stop the running part too
    environment = probe_environment()
    if "error" in environment:
        print(f"GPU check: {environment['error']}. Nothing was run.", file=sys.stderr)
        return 2
    if not environment["cuda_available"] and not args.dry_run:
        print(
            f"GPU check: this machine has no CUDA GPU (torch {environment['torch']}, CUDA build "
            f"{environment['cuda'] or 'none'}): nothing was run. Run it on a CUDA machine, or add --dry-run to "
            "run every part on the CPU with tiny shapes.",
            file=sys.stderr,
        )
        return 2
    parts = tuple(p for p in PARTS if args.only is None or p.name in args.only)
    machine = environment.get("gpu") or "CPU (dry run)"
    print(f"GPU check on {machine}: torch {environment['torch']}, CUDA {environment['cuda'] or 'none'}; "
          f"{len(parts)} parts in at most {args.budget_s:.0f} s; report in {args.out_dir}", flush=True)
    command = shlex.join(["python", "benchmarks/gpu/check.py", *(sys.argv[1:] if argv is None else argv)])
    report = run_check(
        parts, args.out_dir, budget_s=args.budget_s, dry_run=args.dry_run, environment=environment, command=command
    )
    print(render_markdown(report), flush=True)
    failed = [p["name"] for p in report["parts"] if p["status"] in ("failed", "timed out")]
    outcome = f"; failed: {', '.join(failed)}" if failed else ""
    print(f"GPU check: {len(parts) - len(failed)} of {len(parts)} parts passed or skipped{outcome}. "
          f"Report: {args.out_dir / 'report.md'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
