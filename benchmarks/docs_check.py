"""Docs check: every command block of README.md and docs/*.md runs as written, and prints the figures the docs show.

Why: a doc whose commands fail, or whose figures predate the config they describe, costs a newcomer the first hour
(issue 40: a README command that needed an activation line nobody wrote, planner output of an older config, a
runtime overstated 8x). Run, the docs cannot drift: a config change that moves a figure fails this check until the
doc is updated.

What runs: each fenced block whose info string is ``bash``, ``sh``, ``shell`` or ``console``, and each ``text`` (or
untagged) block whose first line starts with ``$ `` (a transcript: ``$ command`` lines, each followed by what it
prints). A block runs in ``bash`` with ``set -eo pipefail`` (a transcript without ``-e``: its lines show what
fails too), one command per line (``\\`` continues a line), in one
temporary copy of the repository shared by all blocks in document order (README.md first, so a later block may use
what an earlier one wrote), offline (``HF_HUB_OFFLINE=1``, ``HF_DATASETS_OFFLINE=1``, stdin closed), with the
copy's code first on ``PYTHONPATH`` and ``.venv/bin`` first on ``PATH``, as the README's activation line puts it
(the copy's ``.venv`` links to this interpreter's environment).

What is compared, within ``--tolerance`` (default 1%, relative; ``tolerance=5%`` in a block's marker overrides):
- the output block that follows a command block (a fenced block after it, with only blank lines or a marker between,
  whose marker says ``output``): every non-empty line of it but ``...`` must appear in what the block's last command
  printed, with the same words, every figure within the tolerance;
- the lines under each ``$ command`` of a transcript, the same way;
- figures in a command's trailing comment: each ``<number> GiB`` and each ``<n>/<m>`` must be printed by it.

Markers: an HTML comment ``<!-- docs-check: ... -->`` on the line above a fence (blank lines between are allowed):
- ``needs gpu: <why, and the offline alternative>`` (or ``needs hub``, ``needs account``, ``needs network``): not
  run; the reason is printed;
- ``slow``: run by ``make docs-check``, not by ``--fast`` (the test suite's ``tests/test_docs.py``);
- ``timeout=<seconds>``: the block's time cap (default 300 s);
- ``without "<command>"``: leave that line of the block out (the test suite itself: ``make test``);
- ``output`` (on an output block): compare it with the command block above.

Usage::

    python benchmarks/docs_check.py                   # every block (make docs-check; about half an hour of CPU time)
    python benchmarks/docs_check.py --fast            # the blocks not marked slow
    python benchmarks/docs_check.py --list            # what would run, what is skipped and why
    python benchmarks/docs_check.py docs/planner.md   # one document
    python benchmarks/docs_check.py --only README.md:243   # one block, by its fence's line

Exit status 1 when a block fails, times out or prints other figures than its doc.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMAND_LANGUAGES = ("bash", "sh", "shell", "console")
NEEDS = ("gpu", "hub", "account", "network")
DEFAULT_TIMEOUT_S = 300
DEFAULT_TOLERANCE = 0.01
_FENCE = re.compile(r"^(```+|~~~+)\s*([\w-]*)(.*)$")
_MARKER = re.compile(r"^<!--\s*docs-check:(.*?)-->\s*$")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_COMMENT_FIGURE = re.compile(r"(\d[\d,]*(?:\.\d+)?) GiB|\b(\d+)/(\d+)\b")
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_MARK = "@@docs-check-command@@"


@dataclass
class Block:
    """One fenced code block of a document, with its marker."""

    path: Path
    line: int  # 1-based line of the opening fence
    language: str
    text: str
    marker: str = ""
    output: Block | None = None  # the output block that follows it

    @property
    def name(self) -> str:
        path = self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path
        return f"{path}:{self.line}"

    @property
    def needs(self) -> str | None:
        found = re.search(r"\bneeds (" + "|".join(NEEDS) + r")\b:?\s*(.*)", self.marker)
        return f"needs {found.group(1)}: {found.group(2).strip()}" if found else None

    @property
    def slow(self) -> bool:
        return bool(re.search(r"\bslow\b", self.marker))

    @property
    def timeout_s(self) -> float:
        found = re.search(r"\btimeout=(\d+)", self.marker)
        return float(found.group(1)) if found else DEFAULT_TIMEOUT_S

    @property
    def transcript(self) -> bool:
        return self.text.lstrip().startswith("$ ")

    def tolerance(self, default: float) -> float:
        marker = (self.output.marker if self.output else "") + " " + self.marker
        found = re.search(r"\btolerance=([\d.]+)%", marker)
        return float(found.group(1)) / 100 if found else default


@dataclass
class Command:
    """One command of a block, with the lines the doc says it prints (a transcript's, or the output block's)."""

    text: str
    expected: list[str] = field(default_factory=list)

    @property
    def comment_figures(self) -> list[str]:
        comment = _trailing_comment(self.text)
        return [m.group(0) for m in _COMMENT_FIGURE.finditer(comment)] if comment else []


def blocks_of(path: Path) -> list[Block]:
    """The fenced blocks of ``path`` with their markers; an output block is attached to the block before it."""
    lines = path.read_text().splitlines()
    blocks: list[Block] = []
    marker, index = "", 0
    last_end = -10
    while index < len(lines):
        line = lines[index]
        found_marker = _MARKER.match(line.strip())
        if found_marker:
            marker = found_marker.group(1).strip()
            index += 1
            continue
        fence = _FENCE.match(line)
        if fence is None:
            if line.strip():
                marker = ""
            index += 1
            continue
        start, close = index, fence.group(1)
        index += 1
        while index < len(lines) and not lines[index].startswith(close):
            index += 1
        block = Block(path, start + 1, fence.group(2).lower(), "\n".join(lines[start + 1 : index]), marker)
        between = lines[last_end + 1 : start]
        adjacent = blocks and all(not text.strip() or _MARKER.match(text.strip()) for text in between)
        if adjacent and re.search(r"\boutput\b", marker) and blocks[-1].output is None:
            blocks[-1].output = block
        else:
            blocks.append(block)
        marker, last_end = "", index
        index += 1
    return blocks


def runnable(block: Block) -> bool:
    return block.language in COMMAND_LANGUAGES or (block.language in ("", "text") and block.transcript)


def commands_of(block: Block) -> list[Command]:
    """The block's commands, each with the lines the doc says it prints; a ``without "..."`` line is left out."""
    left_out = re.findall(r'without "([^"]+)"', block.marker)
    commands: list[Command] = []
    pending = ""
    for raw in block.text.splitlines():
        if block.transcript and not raw.startswith("$ ") and not pending:
            if commands and raw.strip():
                commands[-1].expected.append(raw)
            continue
        line = raw[2:] if block.transcript and raw.startswith("$ ") else raw
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\") and not _trailing_comment(line):
            pending += line.rstrip()[:-1] + " "
            continue
        text = (pending + line).strip()
        pending = ""
        if not any(text == leave or text.startswith(leave + " ") for leave in left_out):
            commands.append(Command(text))
    if block.output is not None and commands:
        commands[-1].expected = [line for line in block.output.text.splitlines() if line.strip()]
    return commands


def _trailing_comment(line: str) -> str:
    """The ``# ...`` comment at the end of a shell line ('' when none), found as the shell finds it."""
    try:
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.commenters = ""
        lexer.whitespace_split = True
        tokens = list(lexer)
    except ValueError:
        return ""
    for position, token in enumerate(tokens):
        if token.startswith("#") and position > 0:
            return " ".join(tokens[position:])
    return ""


def skeleton(line: str) -> str:
    """``line`` with its figures replaced by ``#`` and its spaces collapsed: what must match word for word."""
    return " ".join(_NUMBER.sub("#", line).split())


def figures(line: str) -> list[float]:
    return [float(number.replace(",", "")) for number in _NUMBER.findall(line)]


def close(documented: float, printed: float, tolerance: float) -> bool:
    return abs(documented - printed) <= tolerance * max(abs(documented), abs(printed)) + 1e-12


def compare(command: Command, printed: str, tolerance: float) -> list[str]:
    """What the doc shows for ``command`` that its output does not (empty when everything matches)."""
    lines = [line for chunk in _ANSI.sub("", printed).splitlines() for line in chunk.split("\r") if line.strip()]
    by_skeleton: dict[str, list[str]] = {}
    for line in lines:
        by_skeleton.setdefault(skeleton(line), []).append(line)
    problems = []
    for expected in command.expected:
        if expected.strip() in ("...", "…"):
            continue
        candidates = by_skeleton.get(skeleton(expected), [])
        if not candidates:
            problems.append(f"not printed: {expected.strip()}")
            continue
        want = figures(expected)
        if not any(all(close(a, b, tolerance) for a, b in zip(want, figures(got))) for got in candidates):
            problems.append(
                f"other figures: the doc shows  {expected.strip()}\n      the command printed {candidates[0].strip()}"
            )
    printed_figures = [m.group(0) for m in _COMMENT_FIGURE.finditer(_ANSI.sub("", printed))]
    for shown in command.comment_figures:
        ok = any(
            skeleton(shown) == skeleton(got)
            and all(close(a, b, tolerance) for a, b in zip(figures(shown), figures(got)))
            for got in printed_figures
        )
        if not ok:
            problems.append(f"the comment's figure {shown!r} is not printed")
    return problems


def fresh_copy(destination: Path) -> Path:
    """The repository's files (tracked, and untracked ones git does not ignore) copied to ``destination``, with a
    ``.venv`` whose entries link to this interpreter's environment, and a fresh install stamp so that ``make`` does
    not reinstall."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT, capture_output=True
    )
    names = [name for name in listed.stdout.decode().split("\0") if name] if listed.returncode == 0 else []
    if not names:
        shutil.copytree(ROOT, destination, ignore=shutil.ignore_patterns(".venv", ".git", "outputs", "wandb"))
    for name in names:
        source = ROOT / name
        if source.is_file():
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, destination / name)
    venv = destination / ".venv"
    venv.mkdir(exist_ok=True)
    for entry in Path(sys.prefix).iterdir():
        if not entry.name.startswith(".") and not (venv / entry.name).exists():
            (venv / entry.name).symlink_to(entry)
    (venv / ".lit-memtrain-installed").touch()  # the Makefile's stamp, newer than pyproject.toml
    return destination


def environment(copy: Path) -> dict[str, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(copy), os.environ.get("PYTHONPATH", "")]))
    env["PATH"] = f"{copy / '.venv' / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(copy / ".venv")
    return env


def run_block(block: Block, copy: Path, tolerance: float) -> tuple[bool, str]:
    """Run ``block`` in ``copy``; whether it passed, and what to say about it."""
    commands = commands_of(block)
    # A transcript shows what its commands print, errors included: their exit status is not checked.
    script = ["set -o pipefail" if block.transcript else "set -eo pipefail", "exec 2>&1"]
    for number, command in enumerate(commands):
        script += [f"echo {_MARK}{number}", command.text]
    process = subprocess.Popen(
        ["bash", "-c", "\n".join(script)], cwd=copy, env=environment(copy), stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, text=True, errors="replace", start_new_session=True,
    )  # fmt: skip
    try:
        output, _ = process.communicate(timeout=block.timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # the block's commands and whatever they started
        output, _ = process.communicate()
        return False, f"timed out after {block.timeout_s:.0f} s:\n{output[-2000:]}"
    stdout = output.replace(f"{copy}/", "")  # paths in the copy, as the doc writes them: relative
    parts = re.split(rf"^{_MARK}(\d+)$", stdout, flags=re.MULTILINE)
    printed = {int(parts[i]): parts[i + 1] for i in range(1, len(parts) - 1, 2)}
    if process.returncode != 0 and not block.transcript:
        failed = commands[max(printed)].text if printed else "(before the first command)"
        return False, f"exit status {process.returncode} from: {failed}\n{stdout[-3000:]}"
    problems = []
    for number, command in enumerate(commands):
        for problem in compare(command, printed.get(number, ""), block.tolerance(tolerance)):
            problems.append(f"{command.text}\n    {problem}")
    return not problems, "\n".join(problems)


def _children_cpu_s() -> float:
    """CPU seconds the finished child processes took (user + system): a block's cost on a shared machine."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def documents(given: list[str]) -> list[Path]:
    if given:
        return [Path(name).resolve() for name in given]
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("documents", nargs="*", help="markdown files (default: README.md and docs/*.md)")
    parser.add_argument("--fast", action="store_true", help="leave out the blocks marked slow")
    parser.add_argument("--list", action="store_true", help="say what would run and what is skipped, run nothing")
    parser.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE, help="relative, for figures (0.01)")
    parser.add_argument("--only", nargs="+", default=[], help="blocks by name (README.md:180) or name part")
    parser.add_argument("--keep", action="store_true", help="keep the temporary copy and say where it is")
    args = parser.parse_args(argv)
    blocks = [block for path in documents(args.documents) for block in blocks_of(path) if runnable(block)]
    if args.only:
        blocks = [block for block in blocks if any(part in block.name for part in args.only)]
    failed, ran = [], 0
    with tempfile.TemporaryDirectory(prefix="docs-check-") as temporary:
        copy = fresh_copy(Path(temporary) / "repo")
        for block in blocks:
            commands = " ; ".join(command.text.split("#")[0].strip()[:60] for command in commands_of(block))[:150]
            if block.needs:
                print(f"SKIP {block.name} ({block.needs}) {commands}", flush=True)
                continue
            if args.fast and block.slow:
                print(f"SKIP {block.name} (slow: make docs-check runs it) {commands}", flush=True)
                continue
            if args.list:
                print(f"RUN  {block.name} (cap {block.timeout_s:.0f} s) {commands}", flush=True)
                continue
            start, cpu = time.perf_counter(), _children_cpu_s()
            passed, message = run_block(block, copy, args.tolerance)
            ran += 1
            spent = f"{time.perf_counter() - start:.1f} s, {_children_cpu_s() - cpu:.1f} s CPU"
            print(f"{'PASS' if passed else 'FAIL'} {block.name} ({spent}) {commands}", flush=True)
            if not passed:
                failed.append(block.name)
                print("    " + message.replace("\n", "\n    "), flush=True)
        if args.keep:
            kept = Path(tempfile.mkdtemp(prefix="docs-check-kept-"))
            shutil.copytree(copy, kept / "repo", symlinks=True)
            print(f"the copy is kept in {kept / 'repo'}")
    if not args.list:
        failures = f"; failed: {', '.join(failed)}" if failed else ""
        print(f"docs-check: {ran - len(failed)} of {ran} blocks passed{failures}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
