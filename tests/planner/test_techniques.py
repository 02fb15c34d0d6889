"""The planner learns techniques from the callbacks: a technique callback of the user's own, configured in
trainer.callbacks, is named, compared, suggested and simulated like the exported ones, with no list in the planner."""

from __future__ import annotations

from lightning.pytorch import Callback

from lit_memtrain.callbacks import CompareRow, GradientCheckpointing, Suggestion, TechniqueDescription
from lit_memtrain.planner.settings import CallbackSpec, PlanSettings
from lit_memtrain.planner.techniques import comparison_rows, is_technique, suggestions, techniques_of, with_techniques


class FusedKernels(Callback):
    """A user's own technique, placed after tiled MLPs in --compare and first among the suggestions."""

    def __init__(self, width: int = 8) -> None:
        self.width = width

    def describe_for_planner(self) -> TechniqueDescription:
        return TechniqueDescription(
            f"fused kernels of width {self.width}",
            order=35,
            rows=(CompareRow("+ fused kernels", 35),),
            suggestions=(Suggestion("fused kernels (callback FusedKernels)", 5),),
        )


class CountedCheckpointing(GradientCheckpointing):
    """A user's subclass of an exported technique takes its place."""

    fits = 0

    def on_fit_start(self, trainer, pl_module) -> None:
        CountedCheckpointing.fits += 1
        super().on_fit_start(trainer, pl_module)


OWN = f"{__name__}.FusedKernels"


def test_a_technique_callback_of_the_users_own_is_planned_like_the_exported_ones():
    settings = PlanSettings(module={"preset": "tiny-qwen3"}, callbacks=(CallbackSpec(OWN, {"width": 16}),))
    assert is_technique(FusedKernels) and not is_technique(TechniqueDescription)
    assert techniques_of(settings).describe() == "chunked loss, fused kernels of width 16"
    rows = {name: techniques for name, techniques, _ in comparison_rows(settings)}
    assert list(rows)[3:6] == ["+ tiled MLP", "+ fused kernels", "+ offloaded checkpoints"]
    fused = rows["+ fused kernels"]
    assert fused.describe() == "gradient checkpointing, chunked loss, tiled MLP, fused kernels of width 16"
    for below in ("+ offloaded checkpoints", "+ activation offloading", "+ chunked RMSNorm"):
        assert rows[below].callback(FusedKernels) is not None  # the rows below build on it
    assert rows["plain"].callback(FusedKernels) is None
    (spec,) = [spec for spec in with_techniques(settings, fused).callbacks if spec.resolve() is FusedKernels]
    assert spec.init_args == {"width": 16}  # the configured arguments are kept
    assert [text for text, _ in suggestions(settings)][0] == "fused kernels (callback FusedKernels)"


def test_a_configured_subclass_takes_the_place_of_the_exported_technique():
    path = f"{__name__}.CountedCheckpointing"
    settings = PlanSettings(module={"preset": "tiny-qwen3"}, callbacks=(CallbackSpec(path, {"selective": True}),))
    assert techniques_of(settings).describe() == "selective checkpointing, chunked loss"
    rows = [name for name, _, _ in comparison_rows(settings)]
    assert rows.count("+ checkpointing") == 1
    offloaded = {name: techniques for name, techniques, _ in comparison_rows(settings)}["+ offloaded checkpoints"]
    (spec,) = offloaded.callbacks[:1]
    assert spec.resolve() is CountedCheckpointing and spec.init_args == {"offload": True}
