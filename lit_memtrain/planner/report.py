"""The plan as text for a terminal and as JSON for scripts (``lit-memtrain plan --json``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lit_memtrain.planner.plan import Budget, ComparisonRow, breakdown
from lit_memtrain.planner.search import LengthSearch
from lit_memtrain.planner.settings import DPO_MODULE, PlanSettings
from lit_memtrain.planner.step import StepSimulation
from lit_memtrain.planner.techniques import is_technique, techniques_of

__all__ = ["PlanReport"]

GIB = 2**30
_STRATEGY_NOTES = {
    "not_simulated": "trainer.strategy={name!r} shards the model or the sequence across ranks in a way the planner "
    "does not simulate (it simulates lit_memtrain.strategies.FSDP2Strategy and ContextParallelStrategy): the figures "
    "are for one unsharded device, an upper bound of one rank's memory.",
}


@dataclass
class PlanReport:
    """Everything ``lit-memtrain plan`` found for one configuration."""

    settings: PlanSettings
    budget: Budget
    step: StepSimulation
    suggestion: dict[str, Any] | None = None
    search: LengthSearch | None = None
    comparison: list[ComparisonRow] | None = None
    plot: str | None = None

    @property
    def fits(self) -> bool:
        return self.budget.fits(self.step.memory.device_peak)

    def notes(self) -> list[str]:
        notes = list(self.step.notes)
        strategy = self.settings.strategy
        if strategy.kind in _STRATEGY_NOTES:
            notes.insert(0, _STRATEGY_NOTES[strategy.kind].format(name=strategy.name))
        ignored = [spec.name for spec in self.settings.callbacks if spec.name not in _simulated_names(self.settings)]
        if ignored:
            notes.append(f"Callbacks without an effect on the training step's memory: {', '.join(ignored)}.")
        if self.search is not None and self.search.reached_ceiling:
            notes.append(f"The search stopped at its ceiling of {self.search.max_length:,} tokens per row.")
        return notes

    def to_json(self) -> dict[str, Any]:
        memory = self.step.memory
        result: dict[str, Any] = {
            "peak_device_bytes": memory.device_peak,
            "peak_host_bytes": memory.host_peak,
            "breakdown": breakdown(self.step),
            "host_breakdown": {kind: size for kind, size in memory.host_at_peak.items() if size},
            "phase": memory.phase,
            "fits": self.fits,
            "gpu_memory_bytes": self.budget.gpu_memory,
            "margin": self.budget.margin,
            "usable_bytes": self.budget.usable,
            "gpu_memory_source": self.budget.source,
            "sequence_length": self.step.max_length,
            "tokens_per_step": self.step.max_length * self.settings.sequences,
            "module": self.settings.module_class.rsplit(".", 1)[-1],
            "model": _model_name(self.settings),
            "parameters": self.step.parameters,
            "trainable_parameters": self.step.trainable_parameters,
            "layers": self.step.layers,
            "vocab_size": self.step.vocab_size,
            "attention": self.step.attention,
            "precision": self.settings.precision,
            "techniques": techniques_of(self.settings).describe(),
            "strategy": {
                "name": self.settings.strategy.name,
                "world_size": self.settings.strategy.world_size,
                "simulated": self.settings.strategy.kind != "not_simulated",
                "kind": self.settings.strategy.kind,
                "cpu_offload": self.settings.strategy.cpu_offload,
                "context_parallel_size": self.settings.strategy.context_parallel_size,
                "context_parallel_method": self.settings.strategy.context_parallel_method,
            },
            "notes": self.notes(),
        }
        if self.suggestion is not None:
            result["suggestion"] = self.suggestion
        if self.search is not None:
            result["max_length"] = self.search.max_length
            result["too_long"] = self.search.too_long
        if self.comparison is not None:
            result["compare"] = [_row_json(row, self.budget) for row in self.comparison]
        if self.plot is not None:
            result["plot"] = self.plot
        return result

    def to_text(self) -> str:
        memory, settings = self.step.memory, self.settings
        sequences = settings.sequences
        if settings.padding_free:
            rows = f"{sequences} x {self.step.max_length:,} tokens in one padding-free row"
        else:
            rows = f"{sequences} row{'s' if sequences > 1 else ''} of {self.step.max_length:,} tokens"
        if settings.preference:
            kind = "DPO" if settings.module_class == DPO_MODULE else "reward model"
            rows = f"{kind}, {settings.batch_size} pair(s) (chosen and rejected sequences): {rows}"
        lines = [
            f"Model: {_model_name(settings)}, {_count(self.step.parameters)} parameters "
            f"({_count(self.step.trainable_parameters)} trainable), {self.step.layers} decoder layers, "
            f"vocabulary {self.step.vocab_size:,}",
            f"Step: {rows}, {settings.precision}, "
            f"{settings.accumulate_grad_batches} micro-batch(es) per optimizer step, strategy {settings.strategy.name} "
            f"({_ranks(settings)})",
            f"Techniques: {techniques_of(settings).describe()}",
            "",
            f"Peak device memory per rank: {memory.device_peak / GIB:,.2f} GiB, in {memory.phase}",
        ]
        for kind, size in breakdown(self.step).items():
            lines.append(f"  {kind.replace('_', ' '):<17}{size / GIB:>10,.2f} GiB")
        host = ", ".join(
            f"{kind.replace('_', ' ')} {size / GIB:,.2f}" for kind, size in memory.host_at_peak.items() if size
        )
        lines.append(f"Peak host memory: {memory.host_peak / GIB:,.2f} GiB" + (f" ({host})" if host else ""))
        lines += ["", self._verdict()]
        if self.suggestion is not None:
            lines.append(_suggestion_text(self.suggestion, self.budget, settings))
        if self.search is not None:
            lines.append(_length_text(self.search, settings))
        if self.comparison is not None:
            lines += ["", *_comparison_table(self.comparison, self.budget, self.step.max_length)]
        if self.plot is not None:
            lines.append(f"Plot: {self.plot}")
        notes = self.notes()
        if notes:
            lines += ["", "Notes:", *(f"- {note}" for note in notes)]
        return "\n".join(lines)

    def _verdict(self) -> str:
        budget, peak = self.budget, self.step.memory.device_peak
        usable, difference = budget.usable / GIB, abs(budget.usable - peak) / GIB
        header = (
            f"GPU memory: {budget.gpu_memory / GIB:,.2f} GiB ({budget.source}); a margin of {budget.margin:.0%} is "
            f"kept for the CUDA context, kernel workspaces and fragmentation: {usable:,.2f} GiB usable."
        )
        if self.fits:
            return f"{header}\nFITS: {peak / GIB:,.2f} GiB of {usable:,.2f} GiB usable ({difference:,.2f} GiB spare)."
        needed = f"{peak / GIB:,.2f} GiB needed, {usable:,.2f} GiB usable ({difference:,.2f} GiB over)"
        return f"{header}\nDOES NOT FIT: {needed}."


def _ranks(settings: PlanSettings) -> str:
    strategy = settings.strategy
    text = f"{strategy.world_size} rank(s)"
    if strategy.sharded:
        cp = strategy.context_parallel_size
        text += ", parameters, gradients and optimizer state sharded over all of them"
        if strategy.cpu_offload:
            text += " and kept in host memory"
        if cp > 1:
            text += f"; each sequence split over {cp} ranks ({strategy.context_parallel_method})"
        text += "; the figures are for one rank"
    return text


def _count(number: int) -> str:
    return f"{number / 1e9:.2f}B" if number >= 1e9 else f"{number / 1e6:.2f}M"


def _simulated_names(settings: PlanSettings) -> set[str]:
    return {spec.name for spec in settings.callbacks if is_technique(spec.resolve())}


def _model_name(settings: PlanSettings) -> str:
    module = settings.module
    if module.get("model"):
        return str(module["model"])
    if module.get("preset"):
        return f"preset {module['preset']}"
    return f"config ({module['config'].get('model_type', '?')})"


def _suggestion_text(suggestion: dict[str, Any], budget: Budget, settings: PlanSettings) -> str:
    peak = suggestion["peak_device_bytes"] / GIB
    if suggestion["fits"]:
        return f"To fit, add: {'; '.join(suggestion['add'])} (peak then {peak:,.2f} GiB)."
    added = f"Even with {'; '.join(suggestion['add'])}," if suggestion["add"] else "With every technique on,"
    fixed = suggestion["fixed_bytes"]
    text = (
        f"{added} the peak is {peak:,.2f} GiB, of which parameters, gradients and optimizer state take "
        f"{fixed / GIB:,.2f} GiB."
    )
    state_options = (
        "train a LoRA adapter (--model.lora.r=16), keep the weights in bf16 (--model.dtype=bfloat16), or shard them or "
        "keep them in host memory (--trainer.strategy=lit_memtrain.strategies.FSDP2Strategy, cpu_offload: true)"
    )
    length_options = "lower data.max_length (--find-max-length gives the longest that fits)"
    if not settings.preference:  # DPOModule and RewardModule refuse context parallelism
        length_options += (
            " or split the sequence across GPUs (lit_memtrain.strategies.ContextParallelStrategy; plan it with "
            "--context-parallel-size)"
        )
    if fixed > budget.usable:
        return f"{text} They alone do not fit: {state_options}."
    if fixed > budget.usable / 2:
        return f"{text} To free most of that: {state_options}; or {length_options}."
    return f"{text} {length_options[0].upper()}{length_options[1:]}."


def _length_text(search: LengthSearch, settings: PlanSettings) -> str:
    if search.max_length == 0:
        return "Longest max_length that fits: none (not even 1,024 tokens per row)."
    if search.too_long is None:
        bound = "the search's ceiling"
    else:  # 1% of the length, but at least 1,024 tokens: a larger share at short lengths
        gap = search.too_long - search.max_length
        bound = f"{search.too_long:,}, {gap:,} tokens or {100 * gap / search.max_length:.1f}% longer, does not fit"
    return (
        f"Longest max_length that fits: {search.max_length:,} tokens per row ({bound}; {len(search.peaks)} lengths "
        f"simulated); configured: {settings.max_length:,}."
    )


def _row_json(row: ComparisonRow, budget: Budget) -> dict[str, Any]:
    result: dict[str, Any] = {"technique": row.name, "simulated": row.step is not None}
    if row.note:
        result["note"] = row.note
    if row.step is not None:
        result.update(peak_device_bytes=row.step.memory.device_peak, peak_host_bytes=row.step.memory.host_peak,
                      fits=budget.fits(row.step.memory.device_peak))  # fmt: skip
    if row.search is not None:
        result["max_length"] = row.search.max_length
        result["too_long"] = row.search.too_long
    return result


def _comparison_table(rows: list[ComparisonRow], budget: Budget, length: int) -> list[str]:
    lines = [
        f"| technique (each row adds to the one above) | peak at {length:,} tokens | host | fits | "
        "longest max_length |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        if row.step is None:
            lines.append(f"| {row.name} | {row.note} | | | |")
            continue
        memory = row.step.memory
        longest = f"{row.search.max_length:,}" if row.search is not None else ""
        name = f"{row.name} ({row.note})" if row.note else row.name
        lines.append(
            f"| {name} | {memory.device_peak / GIB:,.2f} GiB | {memory.host_peak / GIB:,.2f} GiB | "
            f"{'yes' if budget.fits(memory.device_peak) else 'no'} | {longest} |"
        )
    return lines
