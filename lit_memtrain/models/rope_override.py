"""Checking a ``rope_parameters`` override (YaRN, given in ``model_init_kwargs``) against the model's own.

Why: transformers 5 replaces a config's ``rope_parameters`` whole with the dict given to ``from_pretrained`` or
``from_config``; it does not merge it. Keys that describe the architecture rather than the scaling go with it: a
model whose heads rotate only part of their dimensions (GLM, GLM-4, GLM-4.5, GPT-NeoX/Pythia: ``partial_rotary_factor``
0.25 to 0.5) and that reads the key with a default of 1.0 then rotates every dimension, a different model from the
one trained, and nothing says so; a left-out ``rope_theta`` changes every frequency (the loss starts near 10 instead
of 4). So an override that leaves out either key the model's own parameters hold is refused, naming the dict to
give instead; nothing is merged behind the user's back. A model that keeps its parameters per layer type (Gemma 3:
``full_attention`` and ``sliding_attention``) ignores a single dict: transformers keeps each layer type's own, and
the YaRN asked for never applies; such an override is refused too.

Example:
    >>> from transformers import AutoConfig
    >>> own = AutoConfig.for_model("glm")  # rope_parameters: partial_rotary_factor 0.5, rope_theta 10000.0
    >>> yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192}
    >>> check_rope_override(own, yarn)  # doctest: +SKIP
    ValueError: model_init_kwargs rope_parameters replaces the model's own rope_parameters whole (...) and leaves out
    partial_rotary_factor=0.5, rope_theta=10000.0, which the model was trained with: ...
"""

from __future__ import annotations

from typing import Any

__all__ = ["ARCHITECTURE_ROPE_KEYS", "check_rope_override"]

ARCHITECTURE_ROPE_KEYS = ("partial_rotary_factor", "rope_theta")
"""Keys of ``rope_parameters`` that belong to the model, whatever its RoPE scaling: an override must keep them."""

_READ_WHEN_ABSENT = {"partial_rotary_factor": 1.0}
"""What transformers reads for a key an override leaves out (``rope_parameters.get(key, 1.0)``): a model whose own value
is that one (Phi-3 keeps ``partial_rotary_factor: 1.0``) computes the same without it, and is not refused."""


def _is_per_layer_type(parameters: dict[str, Any]) -> bool:
    """Whether ``parameters`` holds one dict per layer type (Gemma 3's ``full_attention`` / ``sliding_attention``)."""
    return bool(parameters) and all(isinstance(value, dict) for value in parameters.values())


def check_rope_override(own_config: Any, override: Any) -> None:
    """Refuse a ``rope_parameters`` ``override`` that leaves out an :data:`ARCHITECTURE_ROPE_KEYS` key the model's own
    config (``own_config``, built without the override) holds, or that is one dict for a model that keeps one per
    layer type.

    Raises:
        ValueError: naming each key left out with the model's value and the override with them added, or the
            model's own per-layer-type parameters.
    """
    own = getattr(own_config, "rope_parameters", None)
    if not isinstance(override, dict) or not isinstance(own, dict):
        return
    if _is_per_layer_type(own) and not _is_per_layer_type(override):
        raise ValueError(
            f"model_init_kwargs rope_parameters is one dict, but the model keeps its rope_parameters per layer type "
            f"({', '.join(map(repr, own))}): transformers then keeps each layer type's own and the override changes "
            f"nothing, silently. Give one dict per layer type, changing those to scale; the model's own are {own!r}."
        )
    if not _is_per_layer_type(own) and _is_per_layer_type(override):
        return  # transformers decides what such an override means
    pairs = [("", own, override)] if not _is_per_layer_type(own) else [
        (f"[{key!r}]", own[key], value) for key, value in override.items() if isinstance(own.get(key), dict)
    ]
    for where, own_parameters, given in pairs:
        missing = {key: own_parameters[key] for key in ARCHITECTURE_ROPE_KEYS if key in own_parameters}
        missing = {key: value for key, value in missing.items()
                   if key not in given and value != _READ_WHEN_ABSENT.get(key)}  # fmt: skip
        if missing:
            left_out = ", ".join(f"{key}={value!r}" for key, value in missing.items())
            raise ValueError(
                f"model_init_kwargs rope_parameters{where} replaces the model's own rope_parameters{where} whole "
                f"(transformers does not merge them) and leaves out {left_out}, which the model was trained with: "
                f"without them it would compute something else, silently. Give {({**given, **missing})!r}."
            )
