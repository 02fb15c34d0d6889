"""The GPU check (benchmarks/gpu/check.py) on the CPU: its dry run on a machine without the optional
packages, its refusal without CUDA, and how the runner deals with parts that hang, crash or lack a package.

The dry run (a minute of single-threaded processes) and the imports without the optional packages start early,
in the background (``start_early``, tests/conftest.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / "benchmarks" / "gpu"
# What the GPU machine lacks (matplotlib, a declared dependency that GPU tests use, is left in the dry run).
ABSENT = ("datasets", "wandb", "jsonargparse", "flash_attn", "bitsandbytes", "llvmlite", "pyarrow", "trl")

_WITHOUT_PACKAGES = """
import sys

ABSENT = {absent!r}


def _absent(name):
    return name is not None and name.lower().replace("-", "_").partition(".")[0] in ABSENT


class _Without:
    '''Hides the absent packages from a finder, as if not installed: import fails, find_spec returns None and
    importlib.metadata finds no distribution (libraries such as torchmetrics test for it before importing).'''

    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        return None if _absent(name) else self.finder.find_spec(name, path, target)

    def find_distributions(self, context=None):
        found = getattr(self.finder, "find_distributions", lambda context: ())(context)
        return [] if _absent(getattr(context, "name", None)) else [d for d in found if not _absent(d.metadata["Name"])]

    def __getattr__(self, attribute):
        return getattr(self.finder, attribute)


sys.meta_path[:] = [_Without(finder) for finder in sys.meta_path]
"""


@pytest.fixture(scope="module")
def check_module():
    sys.path.insert(0, str(GPU))
    try:
        import check

        yield check
    finally:
        sys.path.remove(str(GPU))


def _variables(extra_path: Path | None = None) -> dict[str, str]:
    paths = [str(path) for path in (extra_path, ROOT) if path is not None]
    python_path = os.pathsep.join([*paths, *filter(None, [os.environ.get("PYTHONPATH")])])
    return {"OMP_NUM_THREADS": "1", "PYTHONPATH": python_path}


def _environment(extra_path: Path | None = None) -> dict[str, str]:
    return dict(os.environ, **_variables(extra_path))


def _bare(directory: Path, absent: tuple[str, ...]) -> Path:
    """A directory whose sitecustomize.py hides the ``absent`` packages from a python started with it on its path
    (written once: the run started early may be reading it when its test asks for the same directory)."""
    site = directory / "sitecustomize.py"
    if not site.exists():
        directory.mkdir(parents=True, exist_ok=True)
        site.write_text(_WITHOUT_PACKAGES.format(absent=absent))
    return directory


def _dry_run(python) -> tuple[tuple[str, ...], dict]:
    """``check.py --dry-run`` in a fresh python that lacks the optional packages, in a directory of the session."""
    directory = python.directory / "gpu-check"
    bare = _bare(directory / "bare", ABSENT)
    return (str(GPU / "check.py"), str(directory / "out"), "--dry-run"), {
        "fresh": True, "env": _variables(bare), "cwd": str(directory),
    }  # fmt: skip


def _imports(python) -> tuple[tuple[str, ...], dict]:
    """Importing the package and every GPU script in a fresh python that lacks matplotlib too."""
    bare = _bare(python.directory / "gpu-check-imports", (*ABSENT, "matplotlib"))
    modules = ["lit_memtrain", "lit_memtrain.objectives.causal_lm", "lit_memtrain.callbacks",
               "lit_memtrain.planner.simulate", *sorted(path.stem for path in GPU.glob("*.py"))]  # fmt: skip
    code = (f"import importlib, sys; sys.path.insert(0, {str(GPU)!r})\n"
            f"for name in {modules!r}: importlib.import_module(name)")  # fmt: skip
    return ("-c", code), {"fresh": True, "env": _variables(bare)}


def start_early(python) -> None:
    """Queued when collection ends (tests/conftest.py)."""
    for run in (_dry_run, _imports):
        args, options = run(python)
        python.start(*args, **options)


def test_dry_run_without_the_optional_packages_runs_every_part_and_writes_the_report(preloaded_python):
    args, options = _dry_run(preloaded_python)
    bare, out = Path(options["cwd"]) / "bare", Path(args[1])
    probe = subprocess.run(
        [sys.executable, "-c", "import importlib.util; assert importlib.util.find_spec('datasets') is None; import datasets"],
        capture_output=True, text=True, env=_environment(bare), timeout=60,
    )
    assert "No module named 'datasets'" in probe.stderr  # the emulation of a bare machine works

    result = preloaded_python.run(*args, **options, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    report = json.loads((out / "report.json").read_text())
    parts = {part["name"]: part for part in report["parts"]}
    assert list(parts) == ["step profile", "step profile compiled", "context parallel", "planner", "max length",
                           "offload 36 layers", "offload", "fsdp2", "gpu tests", "packed attention", "grpo vllm"]
    assert parts["grpo vllm"]["status"] == "skipped" and "vllm" in json.dumps(parts["grpo vllm"])  # not installed
    for name in ("gpu tests", "offload", "offload 36 layers", "packed attention", "planner", "step profile",
                 "step profile compiled", "max length"):
        assert parts[name]["status"] == "passed", parts[name]
        assert all(item["passed"] for item in parts[name]["result"]["checks"])
    for name, script in (("fsdp2", "fsdp2.py"), ("context parallel", "context_parallel.py")):
        expected = "passed" if (GPU / script).exists() else "skipped"
        assert parts[name]["status"] == expected, parts[name]

    tests = parts["gpu tests"]["result"]["tables"][0]["rows"]
    assert len(tests) >= 7  # collected (none lacks a package), then skipped for want of CUDA
    assert {row[1] for row in tests} == {"skipped"} and all("CUDA" in row[3] for row in tests), tests
    offload = {row[0]: row for row in parts["offload"]["result"]["tables"][0]["rows"]}
    assert offload["checkpointing + offload"][5] > 0 and offload["no checkpointing + offload"][5] > 0
    planner = parts["planner"]["result"]["tables"][0]["rows"]
    assert [(row[0], row[1]) for row in planner] == [(64, "full"), (64, "offload"), (128, "full"), (128, "offload")]
    assert all(row[2] > 0 and row[3] is None for row in planner)  # predicted; nothing measured on the CPU
    assert planner[2][2] > planner[0][2]  # more tokens, more memory

    speed, shares, kernels, memory = (t["rows"] for t in parts["step profile"]["result"]["tables"])
    assert speed[0][0] == "lit-memtrain fit" and speed[0][4] > 0 and speed[1][0] == "TRL SFTTrainer (skipped: trl missing)"
    assert [row[0] for row in shares][:4] == ["attention", "matmul", "chunked loss", "optimizer"]
    assert 0.99 < sum(row[1] for row in shares) < 1.01 and all(row[1] >= 0 for row in shares)
    # Lightning runs the forward and backward inside Optimizer.step (its closure): they are not the optimizer's.
    shares = dict(shares)
    assert shares["matmul"] > 0 and shares["attention"] > 0 and shares["optimizer"] < 0.2, shares
    assert {row[1] for row in kernels} >= {"matmul", "attention"} and len(kernels) == 12
    assert all(row[2] >= 1 and row[3] > 0 and 0 < row[5] < 1 for row in kernels), kernels
    assert memory[0][0] > 0 and memory[0][2] is None  # planned; nothing measured on the CPU
    compiled = parts["step profile compiled"]["result"]["tables"][0]["rows"]
    assert compiled[0][0] == "lit-memtrain fit, compiled layers" and compiled[0][4] > 0
    lengths = parts["max length"]["result"]["tables"][0]["rows"]
    assert [row[0] for row in lengths] == ["+ chunked loss"] and lengths[0][2] >= 1024 and lengths[0][3] == lengths[0][2]

    markdown = (out / "report.md").read_text()
    assert "no GPU (dry run on the CPU: figures mean nothing)" in markdown
    assert f"torch {report['environment']['torch']}, CUDA none" in markdown
    assert "| gpu tests | **passed** |" in markdown
    assert "| checkpointing + offload | 256 |" in markdown
    assert "`python benchmarks/gpu/check.py " in markdown
    assert "[" in result.stdout and "offload: passed in" in result.stdout  # a progress line per part


def test_the_package_and_every_gpu_script_import_without_the_optional_packages_and_matplotlib(preloaded_python):
    """matplotlib is a declared dependency but not one of what a bare GPU machine has: only plots need it."""
    args, options = _imports(preloaded_python)
    result = preloaded_python.run(*args, **options, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert {"check", "offload", "planner_vs_measured"} <= {path.stem for path in GPU.glob("*.py")}


def test_without_cuda_it_stops_at_once_with_a_clear_message(tmp_path):
    result = subprocess.run(
        [sys.executable, str(GPU / "check.py"), str(tmp_path / "out")],
        capture_output=True, text=True, env=_environment(), timeout=120,
    )
    assert result.returncode == 2
    assert "this machine has no CUDA GPU" in result.stderr
    assert "add --dry-run" in result.stderr
    assert not (tmp_path / "out").exists()


def test_the_one_command_for_a_lent_gpu_passes_its_arguments_and_returns_three_files(tmp_path):
    """benchmarks/gpu/lent_gpu.sh as a lent machine runs it (with python3 and make in the repository root): with no
    arguments check.py gets none (an empty one would stop it before any part), with some it gets them as given,
    and a dry run leaves the report and the parts' files in $OUT."""
    def lent(*arguments: str) -> subprocess.CompletedProcess:
        out = tmp_path / f"out{len(arguments)}"
        out.mkdir()
        return subprocess.run(["bash", str(GPU / "lent_gpu.sh"), *arguments], cwd=ROOT, capture_output=True,
                              text=True, env=dict(_environment(), OUT=str(out)), timeout=300)  # fmt: skip

    bare = lent()
    assert bare.returncode == 2 and "this machine has no CUDA GPU" in bare.stderr, bare.stderr[-2000:]
    assert ("no wheels in .whl (run 'make gpu-wheels'" in bare.stderr) != any((ROOT / ".whl").glob("*.whl"))
    dry = lent("--dry-run", "--only", "offload")
    assert dry.returncode == 0, (dry.stdout + dry.stderr)[-3000:]
    assert sorted(path.name for path in (tmp_path / "out3").iterdir()) == ["parts-and-logs.tgz", "report.json",
                                                                          "report.md"]  # fmt: skip
    report = json.loads((tmp_path / "out3" / "report.json").read_text())
    assert [part["name"] for part in report["parts"]] == ["offload"]


def _part_script(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / f"{name}.py"
    path.write_text("import json, subprocess, sys, time\nJSON = sys.argv[sys.argv.index('--json') + 1]\n"
                    + textwrap.dedent(body))
    return path


def _is_running(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def test_a_hung_part_is_killed_with_its_children_and_the_others_still_run(check_module, tmp_path):
    Part = check_module.Part
    pid_file = tmp_path / "child.pid"
    parts = (
        Part("hangs", str(_part_script(tmp_path, "hangs", f"""
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
            open({str(pid_file)!r}, "w").write(str(child.pid))
            time.sleep(120)
            """)), limit_s=3),
        Part("crashes", str(_part_script(tmp_path, "crashes", "raise RuntimeError('boom in the part')\n")), limit_s=30),
        Part("needs datasets", str(_part_script(tmp_path, "needs_datasets", """
            raise ModuleNotFoundError("No module named 'datasets'", name="datasets")
            """)), limit_s=30),
        Part("fails a check", str(_part_script(tmp_path, "fails_a_check", """
            result = {"summary": "ratio 0.5x", "config": {},
                      "tables": [{"title": "t", "columns": ["a", "ratio"], "rows": [["x", 0.5]]}],
                      "checks": [{"name": "ratio above 1", "passed": False, "detail": "0.5"}]}
            open(JSON, "w").write(json.dumps(result))
            sys.exit(1)
            """)), limit_s=30),
        Part("passes", str(_part_script(tmp_path, "passes", """
            assert "--dry-run" in sys.argv
            result = {"summary": "all good", "tables": [{"title": "figures", "columns": ["setting", "peak GiB"],
                      "rows": [["plain", 1.5], ["ours", None]]}], "checks": [], "config": {}}
            open(JSON, "w").write(json.dumps(result))
            """)), limit_s=30),
        Part("not written yet", str(tmp_path / "missing.py"), limit_s=30, optional=True),
        Part("required but missing", str(tmp_path / "missing.py"), limit_s=30),
    )
    out = tmp_path / "out"
    report = check_module.run_check(
        parts, out, budget_s=300, dry_run=True, environment={"torch": "x", "packages": {}}, command="check"
    )
    status = {part["name"]: (part["status"], part["reason"]) for part in report["parts"]}
    assert status == {
        "hangs": ("timed out", "killed at its limit of 3 s"),
        "crashes": ("failed", "exit status 1"),
        "needs datasets": ("skipped", "needs datasets, which is not installed"),
        "fails a check": ("failed", "failed checks: ratio above 1"),
        "passes": ("passed", ""),
        "not written yet": ("skipped", f"{tmp_path / 'missing.py'} does not exist yet"),
        "required but missing": ("failed", f"{tmp_path / 'missing.py'} does not exist yet"),
    }
    assert report["parts"][0]["seconds"] < 15
    assert not _is_running(int(pid_file.read_text()))
    assert "boom in the part" in report["parts"][1]["output_tail"]
    markdown = (out / "report.md").read_text()
    assert "| plain | 1.500 |\n| ours | n/a |" in markdown
    assert "| x | 0.500 |" in markdown and "- **FAILED**: ratio above 1 (0.5)" in markdown
    assert "RuntimeError: boom in the part" in markdown  # the end of a failed part's output
    assert json.loads((out / "report.json").read_text()) == json.loads(json.dumps(report))


def test_a_part_stopped_while_writing_its_results_is_reported_and_the_next_runs(check_module, tmp_path):
    """Killed at its limit in the middle of its JSON, a part used to stop the whole check (the runner read the half
    file and raised): every later part lost, on a lent GPU."""
    Part = check_module.Part
    parts = (
        Part("cut short", str(_part_script(tmp_path, "cut_short", """
            open(JSON, "w").write('{"summary": "half wri')
            time.sleep(120)
            """)), limit_s=3),
        Part("writes nonsense", str(_part_script(tmp_path, "nonsense", "open(JSON, 'w').write('{')\n")), limit_s=30),
        Part("passes", str(_part_script(tmp_path, "passes", """
            open(JSON, "w").write(json.dumps({"summary": "ok", "tables": [], "checks": [], "config": {}}))
            """)), limit_s=30),
    )
    report = check_module.run_check(
        parts, tmp_path / "out", budget_s=300, dry_run=True, environment={"torch": "x", "packages": {}}, command="check"
    )
    status = {part["name"]: (part["status"], part["reason"]) for part in report["parts"]}
    assert status["cut short"][0] == "timed out"
    assert status["cut short"][1].startswith("killed at its limit of 3 s; its results (cut_short.json) are not JSON: ")
    assert status["writes nonsense"][0] == "failed" and "(writes_nonsense.json) are not JSON" in status["writes nonsense"][1]
    assert status["passes"] == ("passed", "")


def test_parts_left_without_time_are_not_started(check_module, tmp_path):
    never = check_module.Part("late", str(_part_script(tmp_path, "late", "open(JSON, 'w').write('{}')\n")), limit_s=60)
    report = check_module.run_check(
        (never,), tmp_path / "out", budget_s=check_module.MIN_PART_S - 1, dry_run=True,
        environment={"packages": {}}, command="check",
    )
    (part,) = report["parts"]
    assert part["status"] == "skipped" and part["reason"].startswith("not started: ")
    assert not (tmp_path / "out" / "parts").exists()


def test_gpu_tests_part_counts_a_missing_optional_package_as_skipped(tmp_path):
    sys.path.insert(0, str(GPU))
    try:
        from gpu_tests import read_junit
    finally:
        sys.path.remove(str(GPU))
    (tmp_path / "test_outcomes.py").write_text(textwrap.dedent("""
        import pytest

        def test_passes():
            pass

        def test_needs_datasets():
            raise ModuleNotFoundError("No module named 'datasets'", name="datasets")

        def test_needs_torch_extension():
            raise ModuleNotFoundError("No module named 'torch_missing_extension'")

        def test_fails():
            assert 1 == 2

        @pytest.mark.skip(reason="needs CUDA")
        def test_skipped():
            pass
    """))
    (tmp_path / "test_uncollectable.py").write_text("raise ModuleNotFoundError(\"No module named 'wandb.sdk'\")\n")
    junit = tmp_path / "junit.xml"
    subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--continue-on-collection-errors",
         f"--junitxml={junit}", "test_outcomes.py", "test_uncollectable.py"],
        cwd=tmp_path, capture_output=True, timeout=120,
    )
    outcomes = {row[0].split("::")[-1].rsplit(".", 1)[-1]: (row[1], row[3]) for row in read_junit(junit)}
    assert outcomes == {
        "test_passes": ("passed", ""),
        "test_needs_datasets": ("skipped", "needs datasets, which is not installed"),
        "test_needs_torch_extension": ("failed", "ModuleNotFoundError: No module named 'torch_missing_extension'"),
        "test_fails": ("failed", "assert 1 == 2"),
        "test_skipped": ("skipped", "needs CUDA"),
        "test_uncollectable": ("skipped", "needs wandb, which is not installed"),
    }


def test_step_profile_classifies_cuda_kernels_by_what_launched_them(check_module):
    """The step profile's shares on a GPU, from kernel names as CUDA's profiler gives them: Lightning runs the forward
    and backward inside ``Optimizer.step`` (its closure), so that range marks nothing; the optimizer is its kernels."""
    import step_profile

    step = "Optimizer.step#AdamW.step"
    cases = {
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", ("aten::mm", "aten::linear", step)): "matmul",
        ("nvjet_hsh_128x256_64x4_2x1_v_bz_coopA_NNT", ("aten::mm", "autograd::engine::evaluate_function: "
                                                       "MmBackward0")): "matmul",
        ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>",
         ("aten::add", step)): "other kernels",
        ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>",
         ("aten::_fused_adamw_", step)): "optimizer",
        ("void at::native::lpnorm_cleanup<float, 2>", ("aten::_foreach_norm", "clip_gradients")): "optimizer",
        ("flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>>", ("aten::_flash_attention_forward", step)):
            "attention",
        ("sm90_xmma_gemm_bf16bf16_bf16f32", ("aten::mm", "_ChunkedCrossEntropySum", step)): "chunked loss",
    }  # fmt: skip
    assert {key: step_profile.classify(key[0], list(key[1])) for key in cases} == cases


def test_step_profile_refuses_a_compilation_inside_its_timed_steps(check_module):
    """With no warm-up step the first timed step recompiles the compiled layers (first compiled for the rows the setup
    probes run) for its own shapes: the part raises, where tokens/s would otherwise time the compiler unseen."""
    import torch

    import step_profile

    settings = {"preset": "tiny-qwen3", "max_length": 256, "rows": 3, "warmup_steps": 0, "steps": 1, "median_length": 20,
                "device": "cpu", "precision": "32-true", "dtype": "float32", "seed": 0, "compile": True,
                "compile_backend": "aot_eager"}  # the dry run's, with no warm-up step  # fmt: skip
    try:
        with pytest.raises(Exception, match="fail_on_recompile"):
            step_profile.fit_ours(settings)
    finally:
        torch.compiler.set_stance("default")
        torch.compiler.reset()


def test_step_profile_runs_trl_with_the_attention_ours_runs(check_module, tmp_path):
    """TRL's row compares the trainers, not attention kernels: with transformers' sdpa a packed row gets a dense
    L x L mask computed block by block, so TRL trains with the document attention the module picks for the device
    (on the CPU ``sdpa_by_document``), reading the bounds its padding-free collator passes."""
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    import step_profile

    settings = {"preset": "tiny-qwen3", "max_length": 256, "rows": 3, "warmup_steps": 1, "steps": 1, "median_length": 20,
                "device": "cpu", "precision": "32-true", "dtype": "float32", "seed": 0}  # fmt: skip
    trl_run = step_profile.fit_trl(settings, str(tmp_path))
    assert trl_run["attention"] == "sdpa_by_document"
    assert 0 < trl_run["tokens_per_step"] <= 256 and trl_run["tokens_per_s"] > 0
