"""Finding the repeated decoder layers of a model.

Why: checkpointing, tiled MLPs and activation offloading act per decoder layer. They must work on our
``CausalLMModule`` and on a user's own LightningModule holding a Hugging Face model (possibly wrapped by
PEFT), so they search for the layer stack rather than assume an attribute path.
"""

from __future__ import annotations

import functools
import inspect
import operator
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

_LAYER_LIST_NAMES = ("layers", "h", "blocks")


def _is_layer_stack(name: str, module: nn.Module) -> bool:
    if not isinstance(module, nn.ModuleList) or len(module) == 0:
        return False
    kinds = {type(child) for child in module}
    if len(kinds) != 1:
        return False
    from transformers.modeling_layers import GradientCheckpointingLayer

    return isinstance(module[0], GradientCheckpointingLayer) or name.rsplit(".", 1)[-1] in _LAYER_LIST_NAMES


def find_decoder_layers(model: nn.Module, path: str | None = None) -> nn.ModuleList:
    """Return the ``nn.ModuleList`` of decoder layers inside ``model``.

    Args:
        model: any module holding a decoder stack (a LightningModule, a Hugging Face model, a PEFT model).
        path: dotted attribute path to the layer list (``"model.model.layers"``); searched for when omitted.

    Raises:
        ValueError: no layer stack, or several candidate stacks and no ``path`` to choose one.
    """
    if path is not None:
        try:
            found = operator.attrgetter(path)(model)
        except AttributeError as error:
            raise ValueError(f"{type(model).__name__} has no attribute path {path!r}: {error}") from error
        if not isinstance(found, nn.ModuleList):
            raise ValueError(f"{path!r} is a {type(found).__name__}, expected an nn.ModuleList of decoder layers.")
        return found
    candidates = [(name, module) for name, module in model.named_modules() if _is_layer_stack(name, module)]
    if not candidates:
        raise ValueError(
            f"Could not find decoder layers in {type(model).__name__}: no nn.ModuleList of identical blocks named "
            f"{' / '.join(_LAYER_LIST_NAMES)} and no transformers GradientCheckpointingLayer list. "
            "Pass the layers explicitly (for example layers_path='model.layers')."
        )
    if len(candidates) > 1:
        names = ", ".join(repr(name) for name, _ in candidates)
        raise ValueError(
            f"Found several decoder layer stacks in {type(model).__name__}: {names}. "
            "Pass the one to use explicitly (layers_path=...)."
        )
    return candidates[0][1]


def validate_layers_path(layers_path: str | None) -> None:
    """Check ``layers_path`` as the layer callbacks take it: ``None`` (found automatically) or a dotted path."""
    if layers_path is not None and (not isinstance(layers_path, str) or not layers_path):
        raise ValueError(
            f"layers_path must be a dotted attribute path such as 'model.model.layers', got {layers_path!r}."
        )


def wrap_forwards(
    modules: Sequence[nn.Module], wrap: Callable[[nn.Module, Callable[..., Any]], Callable[..., Any]]
) -> Callable[[], None]:
    """Set each module's ``forward`` (on the instance) to ``wrap(module, forward)``.

    Patching the instance, not the class, leaves other models untouched and keeps module hooks outside the
    wrapper. Returns a function that puts the original ``forward`` back.

    What ``wrap`` returns is stored in the module's own ``__dict__``, so it must not hold the module strongly:
    that would be a reference cycle, and a model a user drops would stay in memory, weights and all, until the
    garbage collector next runs (the first GPU check measured earlier configurations' layers this way). So
    ``wrap`` gets a weak proxy of the module, and its forward bound weakly (the class's ``forward``, with its
    name and signature, looked up through a weak reference at each call), or the forward set on the instance
    before, as it is.
    """
    previous = [vars(module).get("forward") for module in modules]
    for module, forward in zip(modules, previous):
        module.forward = wrap(weakref.proxy(module), forward if forward is not None else _weakly_bound_forward(module))

    def restore() -> None:
        for module, forward in zip(modules, previous):
            if forward is None:
                del module.forward
            else:
                module.forward = forward

    return restore


def _weakly_bound_forward(module: nn.Module) -> Callable[..., Any]:
    """``module.forward`` as the class defines it, holding ``module`` by a weak reference only."""
    function, reference = type(module).forward, weakref.ref(module)

    @functools.wraps(function)
    def forward(*args: Any, **kwargs: Any) -> Any:
        return function(reference(), *args, **kwargs)

    forward.__signature__ = inspect.signature(module.forward)  # bound: without ``self``
    return forward
