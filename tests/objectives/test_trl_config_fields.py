"""The option table of docs/online_rl.md against the installed TRL: every field of ``GRPOConfig`` and ``RLOOConfig``
is listed (a TRL upgrade that adds one fails here), a field we say is the same is a parameter with TRL's default,
and a field we do not take fails at construction with its name and the reason.

The docs table is generated from :data:`~lit_memtrain.objectives.trl_config_fields.TRL_FIELDS` and TRL's dataclasses;
after changing either, rewrite it with ``PYTHONPATH=$PWD python tests/objectives/test_trl_config_fields.py``.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import sys
from pathlib import Path

import pytest

from lit_memtrain.objectives.causal_lm import CausalLMModule
from lit_memtrain.objectives.grpo import GRPOModule
from lit_memtrain.objectives.rloo import RLOOModule
from lit_memtrain.objectives.trl_config_fields import TRL_FIELDS

DOCS = Path(__file__).resolve().parents[2] / "docs" / "online_rl.md"
BEGIN, END = "<!-- trl-config-fields: begin (generated) -->", "<!-- trl-config-fields: end -->"


def _trl_defaults() -> tuple[dict[str, object], dict[str, object]]:
    from trl import GRPOConfig, RLOOConfig

    def defaults(config) -> dict[str, object]:
        out = {}
        for field in dataclasses.fields(config):
            if field.default is not dataclasses.MISSING:
                out[field.name] = field.default
            elif field.default_factory is not dataclasses.MISSING:
                out[field.name] = field.default_factory()
            else:
                out[field.name] = "(required)"
        return out

    return defaults(GRPOConfig), defaults(RLOOConfig)


def _parameters(cls) -> dict[str, object]:
    """What ``cls`` takes, with its defaults: its own, GRPOModule's (but GRPOConfig's fields, for RLOO) and
    CausalLMModule's."""
    parameters = {**inspect.signature(CausalLMModule.__init__).parameters}
    for klass in reversed(cls.__mro__):
        if klass in (GRPOModule, RLOOModule):
            parameters.update(inspect.signature(klass.__init__).parameters)
    if cls is RLOOModule:  # RLOO refuses GRPO's own (test_the_refusals_read_well)
        grpo_only = {name for name, entry in TRL_FIELDS.items() if entry.configs == "GRPOConfig"}
        grpo_only |= {"policy_loss"}
        parameters = {name: p for name, p in parameters.items() if name not in grpo_only}
    return {name: p.default for name, p in parameters.items() if p.kind is p.POSITIONAL_OR_KEYWORD}


def render_table() -> str:
    """The docs table: one row per TRL field, TRL's defaults beside what the modules make of it."""
    grpo, rloo = _trl_defaults()

    def cell(defaults: dict[str, object], name: str) -> str:
        return f"`{defaults[name]!r}`".replace("|", "\\|") if name in defaults else "-"

    rows = ["| TRL field | GRPOConfig | RLOOConfig | GRPOModule / RLOOModule | why, or where |",
            "| --- | --- | --- | --- | --- |"]  # fmt: skip
    for name, entry in TRL_FIELDS.items():
        status = f"renamed: {entry.ours}" if entry.status == "renamed" else entry.status
        rows.append(f"| `{name}` | {cell(grpo, name)} | {cell(rloo, name)} | {status} | {entry.why} |")
    return "\n".join(rows)


def test_the_table_names_every_field_of_trls_grpo_and_rloo_configs_once():
    grpo, rloo = _trl_defaults()
    fields = set(grpo) | set(rloo)
    assert not fields - set(TRL_FIELDS), f"TRL fields missing from TRL_FIELDS: {sorted(fields - set(TRL_FIELDS))}"
    assert not set(TRL_FIELDS) - fields, f"not TRL 1.16 fields: {sorted(set(TRL_FIELDS) - fields)}"
    for name, entry in TRL_FIELDS.items():
        expected = "both" if name in grpo and name in rloo else "GRPOConfig" if name in grpo else "RLOOConfig"
        assert entry.configs == expected, name
        assert entry.why or entry.status in ("same", "renamed"), f"{name}: a {entry.status} field needs its reason"
        assert entry.status != "renamed" or entry.ours, name


def test_docs_online_rl_holds_the_generated_table():
    text = DOCS.read_text()
    assert BEGIN in text and END in text, f"docs/online_rl.md lacks the {BEGIN} ... {END} section"
    table = text[text.index(BEGIN) + len(BEGIN) : text.index(END)].strip()
    stale = "the table is stale: rewrite it with python tests/objectives/test_trl_config_fields.py"
    assert table == render_table(), stale
    listed = re.findall(r"^\| `(\w+)` \|", table, flags=re.MULTILINE)
    grpo, rloo = _trl_defaults()
    assert sorted(listed) == sorted(set(grpo) | set(rloo))


@pytest.mark.parametrize(("cls", "config"), [(GRPOModule, "GRPOConfig"), (RLOOModule, "RLOOConfig")])
def test_a_field_we_call_the_same_is_a_parameter_with_trls_default(cls, config):
    grpo, rloo = _trl_defaults()
    trl = grpo if config == "GRPOConfig" else rloo
    parameters = _parameters(cls)
    for name, entry in TRL_FIELDS.items():
        if name not in trl or entry.status != "same":
            continue
        assert name in parameters, f"{cls.__name__} lacks {name}, which the table calls the same as TRL's"
        assert parameters[name] == trl[name], f"{name}: ours {parameters[name]!r}, TRL's {trl[name]!r}"


def _values(name: str) -> object:
    return {"loss_type": "dapo"}.get(name, 1)


@pytest.mark.parametrize("cls", [GRPOModule, RLOOModule])
def test_every_field_we_do_not_take_fails_at_construction_naming_it_and_why(cls):
    """Before any model or tokenizer work: the error names the field and says where it went, or why not."""
    parameters = _parameters(cls)
    config = "GRPOConfig" if cls is GRPOModule else "RLOOConfig"
    checked = 0
    for name, entry in TRL_FIELDS.items():
        if name in parameters and name != "loss_type":
            continue
        with pytest.raises(ValueError) as error:
            cls(reward_funcs=[len], preset="tiny-qwen3", tokenizer="lit-memtrain/embedded", **{name: _values(name)})
        message = str(error.value)
        assert name in message, message
        if entry.status == "renamed":
            assert entry.ours.split("(")[0] in message, message
        elif entry.configs in ("both", config) and entry.status == "not offered":
            assert entry.why in message, message
        checked += 1
    assert checked > 100  # TrainingArguments' and the RL fields we do not take


def test_the_refusals_read_well():
    with pytest.raises(ValueError, match=r"GRPOModule does not offer TRL's use_liger_kernel .*chunked"):
        GRPOModule(reward_funcs=[len], preset="tiny-qwen3", use_liger_kernel=True)
    with pytest.raises(ValueError, match=r"policy_loss='cispo' here"):
        GRPOModule(reward_funcs=[len], preset="tiny-qwen3", loss_type="cispo")
    with pytest.raises(ValueError, match=r"no per_device_train_batch_size .*PromptDataModule\(batch_size=.*prompts"):
        GRPOModule(reward_funcs=[len], preset="tiny-qwen3", per_device_train_batch_size=8)
    with pytest.raises(ValueError, match=r"GRPOModule does not take TRL's normalize_advantages .*RLOOModule"):
        GRPOModule(reward_funcs=[len], preset="tiny-qwen3", normalize_advantages=True)
    with pytest.raises(ValueError, match=r"\['delta'\] are GRPOModule's .*RLOOConfig does not"):
        RLOOModule(reward_funcs=[len], preset="tiny-qwen3", delta=2.0)
    with pytest.raises(TypeError, match="not_a_trl_field"):  # a name TRL does not have either: Python's own error
        GRPOModule(reward_funcs=[len], preset="tiny-qwen3", tokenizer="lit-memtrain/embedded", not_a_trl_field=1)


if __name__ == "__main__":  # rewrite the docs table
    text = DOCS.read_text()
    if BEGIN not in text:
        sys.exit(f"add the lines {BEGIN} and {END} to {DOCS} where the table goes")
    head, rest = text.split(BEGIN, 1)
    DOCS.write_text(f"{head}{BEGIN}\n\n{render_table()}\n\n{END}{rest.split(END, 1)[1]}")
