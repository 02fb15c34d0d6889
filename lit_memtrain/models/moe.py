"""The router load-balancing loss of mixture-of-experts models, as the model itself computes it.

Why: a MoE model trained on cross-entropy alone lets its routers send most tokens to a few experts; the
model's own loss (``model(..., labels=..., output_router_logits=True).loss``) adds
``router_aux_loss_coef`` times a load-balancing loss (Switch Transformer, eqs. 4-6) over every layer's
router logits. The chunked loss never calls the model's head-and-loss forward, so it asks the decoder for the
router logits and calls the same function the model's own forward calls (``load_balancing_loss_func`` of the
model's module: Qwen3-MoE, Mixtral, GPT-OSS, and the many models copied from them).
"""

from __future__ import annotations

import sys
from typing import Any

from torch import Tensor, nn

__all__ = ["has_router", "load_balancing_loss", "router_aux_coefficient"]


def _text_config(model: nn.Module) -> Any:
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _base_model(model: nn.Module) -> nn.Module:
    """The transformers model under a PEFT wrapper."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def has_router(model: nn.Module) -> bool:
    """Whether ``model`` is a mixture-of-experts model that can return its router logits."""
    return hasattr(_text_config(model), "output_router_logits")


def router_aux_coefficient(model: nn.Module, override: float | None) -> float:
    """The weight of the load-balancing loss: ``override`` when given, else the one the model's own forward uses
    (its ``router_aux_loss_coef`` or ``aux_loss_coef``, else its config's ``router_aux_loss_coef``); 0 for a model
    without routers or without a load-balancing loss of its own.

    Raises:
        ValueError: a positive ``override`` for a model without routers, or a negative one.
    """
    if override is not None and override < 0:
        raise ValueError(f"router_aux_loss_coef must be >= 0 (0 turns the load-balancing loss off), got {override}.")
    if not has_router(model):
        if override:
            raise ValueError(
                f"router_aux_loss_coef={override} is set, but {type(_base_model(model)).__name__} has no mixture-of-"
                "experts routers (its config has no output_router_logits). Leave router_aux_loss_coef unset."
            )
        return 0.0
    if override is not None:
        return float(override)
    # The weight the model's own forward adds the loss with: an attribute of the model, taken from its config under a
    # name that varies (JetMoE's ``aux_loss_coef``, DBRX's ``ffn_config.moe_loss_weight``); the config's
    # ``router_aux_loss_coef`` for a model that keeps none. Reading only that config name trained such models
    # without their load-balancing loss, silently.
    base, config = _base_model(model), _text_config(model)
    for holder, name in ((base, "router_aux_loss_coef"), (base, "aux_loss_coef"), (config, "router_aux_loss_coef")):
        value = getattr(holder, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return 0.0


def load_balancing_loss(model: nn.Module, router_logits: tuple[Tensor, ...], attention_mask: Tensor | None) -> Tensor:
    """The model's own load-balancing loss over ``router_logits`` (one [tokens, experts] tensor per layer).

    Raises:
        ValueError: the model's module defines no ``load_balancing_loss_func``, or no router logits came back.
    """
    base = _base_model(model)
    # The module of the model's own class: FSDP2's fully_shard swaps in a subclass defined in torch's module.
    modules = (sys.modules.get(cls.__module__) for cls in type(base).__mro__)
    function = next((module.load_balancing_loss_func for module in modules
                     if hasattr(module, "load_balancing_loss_func")), None)  # fmt: skip
    if function is None or not router_logits:
        raise ValueError(
            f"{type(base).__name__} has routers but its module defines no load_balancing_loss_func (or returned no "
            "router logits), so the chunked loss cannot add the model's load-balancing loss. Use loss_type='nll' "
            "(the model computes it), or router_aux_loss_coef=0 to train without it."
        )
    config = _text_config(model)
    experts = getattr(base, "num_experts", None) or getattr(config, "num_experts", None) or config.num_local_experts
    top_k = getattr(base, "num_experts_per_tok", None) or config.num_experts_per_tok
    return function(tuple(router_logits), experts, top_k, attention_mask)
