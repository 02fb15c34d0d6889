"""Which model a fit builds when its sources name more than one: the one given last, with its own overrides.

Why: :class:`~lit_memtrain.objectives.causal_lm.CausalLMModule` takes exactly one of ``model`` (hub id or path),
``preset`` and ``config``, and the shipped configs name a preset (``configs/quickstart.yaml``, ``configs/dpo.yaml``).
``lit-memtrain fit --config configs/dpo.yaml --model.model ./my_model`` merges to two, which the module refuses.
As everywhere else in LightningCLI, what is given last wins: the sources are applied in order (each ``--config``
file, each run of ``--model.*`` arguments between them), and the last one to name a model replaces the model,
preset or config an earlier one named. The ``config_overrides`` given with an earlier choice describe that
model's shape (hidden size, layer count), so they go with it; overrides given with or after the winning choice
stay. What was replaced is logged on one line, never dropped silently. One source naming two stays an error.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

__all__ = ["CHOICES", "ModelSource", "model_sources", "replace_earlier_choices"]

CHOICES = ("model", "preset", "config")
_TRACKED = (*CHOICES, "config_overrides")
_CONFIG_FLAGS = ("--config", "-c")
_SUBCOMMANDS = ("fit", "validate")


@dataclass
class ModelSource:
    """A config file or a run of ``--model.*`` arguments: the tracked model keys it gives, and whether each value
    is set (``--model.model=null`` gives the key but sets nothing)."""

    name: str
    keys: dict[str, bool] = field(default_factory=dict)

    def sets(self, key: str) -> bool:
        return self.keys.get(key, False)


def model_sources(args: list[str]) -> list[ModelSource]:
    """The sources of ``args`` that give model keys, in the order LightningCLI applies them."""
    sources: list[ModelSource] = []
    index = 0
    while index < len(args):
        arg = args[index]
        flag, has_value, value = arg.partition("=")
        if not has_value and index + 1 < len(args):
            value = args[index + 1]
        consumed = 1 if has_value else 2
        if flag in _CONFIG_FLAGS:
            sources.append(ModelSource(f"--config {value}", _keys_of_section(_model_section(_load(value)))))
            index += consumed
        elif flag == "--model" or flag.startswith("--model."):
            if not sources or sources[-1].name != "the command line":
                sources.append(ModelSource("the command line"))
            if flag == "--model":
                sources[-1].keys.update(_keys_of_section(_load(value)))
            else:
                key = flag.removeprefix("--model.").removeprefix("init_args.").split(".", 1)[0]
                if key in _TRACKED:
                    sources[-1].keys[key] = _parse_value(value) is not None
            index += consumed
        else:
            index += 1
    return [source for source in sources if source.keys]


def replace_earlier_choices(model: MutableMapping[str, Any], args: list[str]) -> str | None:
    """Keep the model choice given last in ``args`` (see the module docstring) in the parsed ``model`` arguments.

    Returns:
        A line saying what was replaced, or None when nothing was.
    """
    sources = model_sources(args)
    choosing = [index for index, source in enumerate(sources) if any(source.sets(key) for key in CHOICES)]
    if not choosing:
        return None
    last = choosing[-1]
    winners = [key for key in CHOICES if sources[last].sets(key)]
    if len(winners) != 1:
        return None  # one source naming two: the module says so
    replaced = {key: model[key] for key in CHOICES if key != winners[0] and model.get(key) is not None}
    overrides_given_since = any("config_overrides" in source.keys for source in sources[last:])
    if model.get("config_overrides") is not None and not overrides_given_since:
        replaced["config_overrides"] = model["config_overrides"]
    if not replaced:
        return None
    for key in replaced:
        model[key] = None
    dropped = ", ".join(f"model.{key}={_plain(value)!r}" for key, value in replaced.items())
    return (
        f"model.{winners[0]}={_plain(model[winners[0]])!r} from {sources[last].name} is given last: it replaces "
        f"{dropped} given before it."
    )


def _load(value: str) -> Any:
    """A config file's contents, or a section given inline as YAML."""
    try:
        if Path(value).is_file():
            return yaml.safe_load(Path(value).read_text())
        return yaml.safe_load(value)
    except (OSError, yaml.YAMLError):
        return None


def _model_section(config: Any) -> Any:
    """A config file's ``model`` section, at the top or under a subcommand's key."""
    if not isinstance(config, dict):
        return None
    if "model" in config:
        return config["model"]
    for subcommand in _SUBCOMMANDS:
        if isinstance(config.get(subcommand), dict) and "model" in config[subcommand]:
            return config[subcommand]["model"]
    return None


def _keys_of_section(section: Any) -> dict[str, bool]:
    if not isinstance(section, dict):
        return {}
    if "class_path" in section:
        section = section.get("init_args") or {}
    return {key: section[key] is not None for key in _TRACKED if key in section}


def _parse_value(value: str) -> Any:
    try:
        return yaml.safe_load(value)
    except yaml.YAMLError:
        return value


def _plain(value: Any) -> Any:
    """A parsed value as plain data (jsonargparse keeps dicts as namespaces only in subclass sections)."""
    return value.as_dict() if hasattr(value, "as_dict") else value
