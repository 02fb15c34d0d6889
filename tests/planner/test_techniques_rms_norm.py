"""The planner's technique switches know ChunkedRMSNorm: described, removed from the comparison's plain rows,
added by its own last row."""

from lit_memtrain.callbacks import ChunkedRMSNorm, TiledMLP
from lit_memtrain.planner.settings import CallbackSpec, PlanSettings
from lit_memtrain.planner.techniques import comparison_rows, techniques_of, with_techniques

NORM = "lit_memtrain.callbacks.ChunkedRMSNorm"


def test_chunked_rms_norm_is_a_technique_of_its_own():
    settings = PlanSettings(module={"preset": "tiny-qwen3"}, callbacks=(CallbackSpec(NORM, {"chunk_elements": 4096}),))
    techniques = techniques_of(settings)
    assert techniques.callback(ChunkedRMSNorm) is not None and techniques.describe().endswith("chunked RMSNorm")
    rows = comparison_rows(settings)
    assert rows[0][0] == "plain" and not with_techniques(settings, rows[0][1]).callbacks
    name, last, _ = rows[-1]
    assert name == "+ chunked RMSNorm" and last.callback(ChunkedRMSNorm) and last.callback(TiledMLP)
    (spec,) = [spec for spec in with_techniques(settings, last).callbacks if spec.resolve() is ChunkedRMSNorm]
    assert spec.init_args == {"chunk_elements": 4096}  # the user's options are kept


def test_a_plan_that_does_not_fit_suggests_the_chunked_norm_among_the_techniques(preloaded_python):
    """In a child process: the simulation's stand-in device must be registered before the first backward."""
    import json

    script = """
import json
from lit_memtrain.planner.simulate import stand_in_device
stand_in_device()
from lit_memtrain.planner.plan import Budget, Planner
from lit_memtrain.planner.settings import PlanSettings
settings = PlanSettings(module={"preset": "tiny-qwen3", "config_overrides": {"vocab_size": 512, "num_hidden_layers": 1}},
                        max_length=1024)
print(json.dumps(Planner(settings, Budget(2**10, margin=0.0), progress=lambda line: None).suggestion()))
"""
    result = preloaded_python.run("-c", script)
    assert result.returncode == 0, result.stderr[-3000:]
    suggestion = json.loads(result.stdout)
    assert not suggestion["fits"]
    assert "chunked RMSNorm (callback lit_memtrain.callbacks.ChunkedRMSNorm)" in suggestion["add"]
