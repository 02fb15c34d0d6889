"""Generating with an FSDP2-sharded model: the root's parameters gathered, and optionally every layer's.

Why: Hugging Face ``generate`` calls the model once per new token. Under FSDP2 each call gathers every decoder
layer's parameters and frees them again: it works with no more memory than training (one layer at a time), but
pays an all-gather per layer per token, and every rank must run as many forwards as the rank with the longest
completion (``synced_gpus``). Gathering the whole model once for the whole generation (TRL's
``ds3_gather_for_generation``, the default there) trades the memory of the full model for one all-gather per
layer per step; then the ranks need not wait for one another.

Either way the root's own parameters (embeddings, final norm, LM head) are gathered first, explicitly: FSDP2
gathers them in the root module's forward, which ``generate`` of a LoRA model (``PeftModel.generate`` calls the
wrapped model's forward directly) never enters. Training keeps them gathered from forward to backward anyway.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

__all__ = ["unsharded_for_generation"]


def _post_forward_state(module: FSDPModule) -> tuple[Any, list[Any]]:
    """Whether ``module`` decides at its first forward if it reshards after forward (the root does), and what each
    of its parameter groups reshards to after forward (``None``: it does not reshard).

    torch has a setter (``set_reshard_after_forward``) but no getter; this reads FSDP2's state so that it can be
    restored exactly (the root's differs from its layers').
    """
    state = module._get_fsdp_state()
    return state._auto_reshard_after_forward, [group.post_forward_mesh_info for group in state._fsdp_param_groups]


def _restore_post_forward_state(module: FSDPModule, saved: tuple[Any, list[Any]]) -> None:
    state = module._get_fsdp_state()
    state._auto_reshard_after_forward, groups = saved
    for group, mesh_info in zip(state._fsdp_param_groups, groups):
        group.post_forward_mesh_info = mesh_info


@contextmanager
def unsharded_for_generation(model: nn.Module, gather_all: bool) -> Iterator[bool]:
    """Keep an FSDP2 model's root parameters (and with ``gather_all`` every layer's) gathered while generating.

    Yields whether the ranks must stay in step while generating (``generate(synced_gpus=...)``): true for a
    sharded model whose layers are still gathered per forward, on more than one rank. A model that is not
    sharded is left as it is (yields False).
    """
    if not isinstance(model, FSDPModule):
        yield False
        return
    # FSDP2 makes the first module to run forward the root; PEFT's generate enters a layer first, which it refuses
    # ("requires running forward through the root module first") before any training forward ran (ExactAnswerAccuracy
    # scores at fit start). torch has no public call for this; its own root forward makes the same one.
    model._get_fsdp_state()._lazy_init()
    gathered = [m for m in model.modules() if isinstance(m, FSDPModule)] if gather_all else [model]
    states = [_post_forward_state(module) for module in gathered]
    try:
        for module in gathered:
            module.set_reshard_after_forward(False, recurse=False)
            module.unshard()
        yield not gather_all and dist.is_initialized() and dist.get_world_size() > 1
    finally:
        for module, state in zip(gathered, states):
            _restore_post_forward_state(module, state)
            module.reshard()
