"""Mutation check: each listed break of the package must make the tests named for it fail.

Why: a test that passes on broken code proves nothing, and a green suite does not show it. Each mutation below is a
small wrong change a real bug could make (a factor, a skipped branch, a wrong unit) with the tests that must catch
it. The script copies the tree (``lit_memtrain``, ``tests``, ``pyproject.toml``) to a temporary directory once per
mutation, replaces ``old`` by ``new`` there (never in the working tree), and runs only the named tests with this
interpreter (the venv's python), with that copy first on ``PYTHONPATH``. A mutation is *caught* when pytest reports
a failed test, and *survived* when the named tests pass. The script exits non-zero when any mutation survives, when a
mutation's ``old`` text is not found exactly once in its file (the list would rot silently as the code moves), or
when pytest ends otherwise (no test collected, an internal error).

Why in benchmarks/ and not in the test suite: it runs a few fits per mutation (minutes in all), so it is a check run
on demand, like the benchmarks, with its last result in docs/benchmarks.md; ``make mutations`` runs it.

Usage::

    python benchmarks/mutations.py                 # every mutation
    python benchmarks/mutations.py -k tiled        # those whose name contains "tiled"
    python benchmarks/mutations.py --list          # names and tests only
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COPIED = ("lit_memtrain", "tests", "pyproject.toml")


@dataclass(frozen=True)
class Edit:
    file: str  # relative to the repository root
    old: str  # found exactly once in the file
    new: str


@dataclass(frozen=True)
class Mutation:
    name: str
    edits: tuple[Edit, ...]
    tests: tuple[str, ...]  # pytest node ids; the mutation is caught when one of them fails


def _skip_modules(file: str, hook: str, names: str) -> Edit:
    """A technique callback's hook returning at once, doing nothing, for modules of the named classes (or their
    subclasses): the technique silently missing for one objective."""
    signature = {
        "on_fit_start": "    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:\n",
        "on_train_batch_start": "    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, "
        "batch: Any, batch_idx: int) -> None:\n",
    }[hook]
    skip = f"        if any(cls.__name__ in {names} for cls in type(pl_module).__mro__):\n            return\n"
    return Edit(file, signature, signature + skip)


CALLBACKS = "lit_memtrain/callbacks/"
GRPO_MEMORY = (
    "tests/objectives/test_grpo.py::test_memory_callbacks_train_as_without_them",
    "tests/objectives/test_grpo.py::test_rloo_trains_with_its_kl_penalty_and_validation_logs_rewards",
)
OBJECTIVES = {  # the module classes a mutation skips, and the fits that must notice
    "grpo-rloo": ("('GRPOModule', 'RLOOModule')", GRPO_MEMORY),
    "dpo": ("('DPOModule',)", ("tests/e2e/test_dpo_fit.py::test_memory_callbacks_train_dpo_as_without_them",)),
    "reward": (
        "('RewardModule',)",
        ("tests/e2e/test_reward_fit.py::test_memory_callbacks_train_a_reward_model_as_without_them",),
    ),
    "sft": (
        "('CausalLMModule',)",
        ("tests/objectives/test_causal_lm.py::test_memory_callbacks_take_effect_and_keep_the_step_mean_gradient",),
    ),
}
THROUGHPUT = (
    "tests/objectives/test_throughput.py::test_throughput_is_measured_every_log_every_n_steps_with_one_sync_each",
    "tests/objectives/test_throughput.py::test_mfu_is_model_flops_per_second_over_the_devices_peak",
)
GENERATE = "lit_memtrain/models/generate.py"
TECHNIQUES = {
    "checkpointing": (CALLBACKS + "gradient_checkpointing.py", "on_fit_start"),
    "tiled-mlp": (CALLBACKS + "tiled_mlp.py", "on_fit_start"),
    "offloading": (CALLBACKS + "activation_offloading.py", "on_train_batch_start"),
}

MUTATIONS: tuple[Mutation, ...] = (
    Mutation(
        "planner: models simulated whole (layers differ, unknown technique) at max_length // 2",
        (Edit("lit_memtrain/planner/step.py", "    whole = _simulate(settings, model, max_length)\n",
              "    whole = _simulate(settings, model, max_length // 2 if reduction else max_length)\n"),),
        ("tests/planner/test_extrapolation.py::test_layers_the_planner_cannot_show_alike_are_simulated_whole_and_the"
         "_notes_say_why",),
    ),
    Mutation(
        "throughput: model FLOPs doubled",
        (Edit("lit_memtrain/objectives/throughput.py", "flops_per_sec = training_flops(model, tokens, self._pairs) /",
              "flops_per_sec = 2 * training_flops(model, tokens, self._pairs) /"),),
        THROUGHPUT,
    ),
    Mutation(
        "throughput: the attention-pair count never reset between windows",
        (Edit("lit_memtrain/objectives/throughput.py", "self._started_at, self._tokens, self._pairs = now, 0, 0",
              "self._started_at, self._tokens = now, 0"),),
        THROUGHPUT,
    ),
    Mutation(
        "throughput: MFU of a bf16-true run measured against the float32 peak (found in review)",
        (Edit("lit_memtrain/objectives/throughput.py", '    if precision.startswith("bf16"):\n',
              '    if precision.startswith("bf16-mixed"):\n'),),
        ("tests/objectives/test_throughput.py::test_mfu_is_logged_on_an_h200",),
    ),
    Mutation(
        "generate: greedy decoding replaced by sampling at T=1 with a fixed seed",
        (Edit(GENERATE, 'else {"do_sample": False}', 'else {"do_sample": True, "temperature": 1.0}'),
         Edit(GENERATE, "    if seed is not None:\n        torch.manual_seed(seed)\n",
              "    torch.manual_seed(0 if seed is None else seed)\n")),
        ("tests/models/test_generate.py::test_generate_works_with_a_tokenizer_that_returns_token_type_ids",),
    ),
    Mutation(
        "generate: top_p ignored (found in this review)",
        (Edit(GENERATE, '"top_p": top_p}', '"top_p": 1.0}'),),
        ("tests/models/test_generate.py::test_sampling_options_sample_and_a_seed_makes_them_reproducible",),
    ),
    Mutation(
        "lora: the QLoRA export merges lora_B scaled by 0.85",
        (Edit("lit_memtrain/models/lora.py", "{name: tensor.detach().cpu() for name, tensor in",
              "{name: tensor.detach().cpu() * (0.85 if 'lora_B' in name else 1) for name, tensor in"),),
        ("tests/models/test_lora.py::test_qlora_export_reloads_the_base_with_the_runs_init_kwargs_dtype_and_trust_"
         "remote_code",),
    ),
    Mutation(
        "TiledMLP silently skips mixture-of-experts models",
        (Edit(CALLBACKS + "tiled_mlp.py", "        self._restore = apply_tiled_mlp(layers, self.num_tiles)\n",
              "        if any(hasattr(layer.mlp, 'experts') for layer in layers):\n            return\n"
              "        self._restore = apply_tiled_mlp(layers, self.num_tiles)\n"),),
        ("tests/models/test_moe.py::test_a_fit_with_tiled_mlp_on_a_mixture_of_experts_model",),
    ),
    Mutation(
        "MemoryMonitor logs RSS in TiB",
        (Edit(CALLBACKS + "memory_monitor.py", '"memory/rss_gib": _process_rss_bytes() / _GIB',
              '"memory/rss_gib": _process_rss_bytes() / 2**40'),),
        ("tests/callbacks/test_memory_monitor.py::test_logs_process_rss_on_cpu_to_logger_and_progress_bar",),
    ),
    Mutation(
        "offloading ends at the first backward of a step (GRPO/RLOO slices after it not offloaded; found in review)",
        (Edit(CALLBACKS + "activation_offloading.py", "    def on_train_batch_end(\n",
              "    def on_after_backward(self, trainer: Trainer, pl_module: LightningModule) -> None:\n"
              "        self._stop()\n\n    def on_train_batch_end(\n"),),
        GRPO_MEMORY,
    ),
    Mutation(
        "planner: varlen_by_document's repeated key/value heads not simulated (torch 2.11's varlen_attn)",
        (Edit("lit_memtrain/planner/simulate.py", "    if _repeat_key_value_heads and key.shape[1] != query.shape[1]:\n",
              "    if False:\n"),),
        ("tests/planner/test_plan.py::test_varlen_without_grouped_heads_is_planned_with_the_repeated_key_and_value_the"
         "_fit_keeps",),
    ),
    Mutation(
        "compiled layers: the document-aware attention captured in the graphs (specialised on each packing)",
        (Edit("lit_memtrain/techniques/attention.py",
              "AttentionInterface.register(SDPA_BY_DOCUMENT, torch.compiler.disable(sdpa_by_document))",
              "AttentionInterface.register(SDPA_BY_DOCUMENT, sdpa_by_document)"),),
        ("tests/callbacks/test_compiled_layers.py::test_one_compilation_serves_every_layer_and_attention_stays_out_of"
         "_the_graphs",),
    ),
    Mutation(
        "compiled layers: compiled through another technique's wrapped forward",
        (Edit("lit_memtrain/techniques/compiled_layers.py", "    wrapped = wrapped_forwards(layers)\n",
              "    wrapped = []\n"),),
        ("tests/callbacks/test_compiled_layers.py::test_what_it_does_not_compose_with_is_refused",),
    ),
    Mutation(
        "packed step: the token count copied to the device again (a sync every step)",
        (Edit("lit_memtrain/objectives/step_tokens.py",
              "tokens = torch.full((), int(tokens), dtype=torch.int64, device=device)",
              "tokens = torch.tensor(tokens, device=device)"),),
        ("tests/objectives/test_device_syncs.py",),
    ),
    Mutation(
        "packed rows: the host copy of the document bounds off by one token",
        (Edit("lit_memtrain/datamodules/padding_free.py", "CU_SEQ_LENS_ON_HOST: tuple(cu_seq_lens.tolist()),",
              "CU_SEQ_LENS_ON_HOST: (0, *(b + 1 for b in cu_seq_lens.tolist()[1:-1]), int(cu_seq_lens[-1])),"),),
        ("tests/datamodules/test_padding_free.py",
         "tests/techniques/test_attention.py::test_module_trains_packed_rows_like_sdpa"),
    ),
    *(
        Mutation(
            f"{technique} skipped for {objective}",
            (_skip_modules(file, hook, names),),
            tests,
        )
        for technique, (file, hook) in TECHNIQUES.items()
        for objective, (names, tests) in OBJECTIVES.items()
    ),
)


def _copy_tree(directory: str) -> Path:
    tree = Path(directory)
    for name in COPIED:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, tree / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(source, tree / name)
    return tree


def _mutated(mutation: Mutation, root: Path) -> dict[str, str] | str:
    """The mutated text of each file the mutation edits under ``root``, or the problem: an ``old`` text that is not
    found exactly once."""
    texts: dict[str, str] = {}
    for edit in mutation.edits:
        text = texts.get(edit.file, None) or (root / edit.file).read_text()
        count = text.count(edit.old)
        if count != 1:
            return f"old text found {count} times in {edit.file} (expected once): {edit.old[:80]!r}"
        texts[edit.file] = text.replace(edit.old, edit.new)
    return texts


def _run(mutation: Mutation, tree: Path) -> tuple[str, str]:
    """(verdict, detail): caught, survived, or error."""
    texts = _mutated(mutation, tree)
    if isinstance(texts, str):
        return "error", texts
    for file, text in texts.items():
        (tree / file).write_text(text)
    path = os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env = {**os.environ, "PYTHONPATH": path, "PYTHONDONTWRITEBYTECODE": "1"}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tree),
               *mutation.tests]
    result = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True)
    failed = re.findall(r"^FAILED (.+?)(?: - .*)?$", result.stdout, flags=re.MULTILINE)
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else result.stderr[-300:]
    if result.returncode == 1 and failed:
        return "caught", ", ".join(name.split("::")[-1] for name in failed)
    if result.returncode == 0:
        return "survived", summary
    return "error", f"pytest exited {result.returncode}: {summary}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-k", dest="keyword", default="", help="only the mutations whose name contains this text")
    parser.add_argument("--list", action="store_true", help="print the mutations and their tests, run nothing")
    parser.add_argument("--no-control", action="store_true", help="skip the run of the named tests unmutated")
    args = parser.parse_args(argv)
    selected = [m for m in MUTATIONS if args.keyword in m.name]
    if not selected:
        parser.error(f"no mutation's name contains {args.keyword!r}")
    if args.list:
        for mutation in selected:
            print(f"{mutation.name}\n    " + "\n    ".join(mutation.tests))
        return 0
    rotted = [f"{m.name}: {problem}" for m in selected if isinstance(problem := _mutated(m, ROOT), str)]
    if rotted:
        print("Mutations whose old text is gone (update the list):\n  " + "\n  ".join(rotted), file=sys.stderr)
        return 1
    rows = []
    if not args.no_control:  # every named test passes on the unmutated copy, or a "caught" would prove nothing
        tests = tuple(dict.fromkeys(test for mutation in selected for test in mutation.tests))
        control = Mutation("control: no mutation, every named test", (), tests)
        with tempfile.TemporaryDirectory(prefix="lit-memtrain-mutation-") as directory:
            start = time.perf_counter()
            verdict, detail = _run(control, _copy_tree(directory))
        seconds = time.perf_counter() - start
        print(f"{'passed' if verdict == 'survived' else 'FAILED'} {seconds:6.1f} s  {control.name}: {detail}")
        if verdict != "survived":
            print("The named tests fail without a mutation: fix them first.", file=sys.stderr)
            return 2
        rows.append((control.name, "passed", seconds, detail))
    for mutation in selected:
        with tempfile.TemporaryDirectory(prefix="lit-memtrain-mutation-") as directory:
            start = time.perf_counter()
            verdict, detail = _run(mutation, _copy_tree(directory))
        seconds = time.perf_counter() - start
        rows.append((mutation.name, verdict, seconds, detail))
        print(f"{verdict:8} {seconds:6.1f} s  {mutation.name}: {detail}", flush=True)
    print("\n| mutation | result | seconds | failing tests (or why) |\n|---|---|---:|---|")
    for name, verdict, seconds, detail in rows:
        print(f"| {name} | {verdict} | {seconds:.0f} | {detail} |")
    bad = [row for row in rows if row[1] not in ("caught", "passed")]
    print(f"\n{len(selected) - len(bad)} of {len(selected)} mutations caught", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
