"""Activation checkpointing of decoder layers: full, selective and offloaded.

Why: without checkpointing a decoder layer keeps dozens of activations for backward (39 tensors per layer
for a Qwen3 layer); with non-reentrant checkpointing it keeps one, its input hidden states ([B, L, H]), and
recomputes the rest in backward. At long context that is the difference between activations growing with
``layers x L x (many H- and I-wide tensors)`` and ``layers x L x H``.

Variants:
- *selective*: also keep the outputs of the attention kernel (SDPA flash / efficient / cuDNN, the CPU flash
  kernel, flash-attn) so backward recomputes the cheap element-wise and matmul parts but not attention,
  the part whose cost grows as L^2. Not a call with attention dropout: it is recomputed, so that the random
  numbers of the layer are drawn in backward as in forward. Price per layer: the attention output ([B, L, heads x head_dim] in the
  activation dtype; ``heads x head_dim`` is not always the hidden size, 4096 vs 2560 for Qwen3-4B) plus its
  fp32 log-sum-exp ([B, heads, L]).
- *offload*: each layer's checkpointed input is held in host memory (pinned on CUDA) from the forward to
  the layer's backward, so device memory no longer grows with the number of layers. The input is saved
  through autograd's saved-tensor machinery when the checkpoint starts, so a ``save_on_cpu`` context
  around the checkpoint call moves it, while the tensors saved inside the layer stay under the
  checkpoint's own hooks (they are recomputed, not stored). Only positional tensor arguments are inputs
  in this sense; Hugging Face decoder layers take the hidden states positionally. Tensors passed by keyword
  (position ids, RoPE cos/sin) are shared by all layers and stay where they are. Attention outputs kept by
  *selective* stay on the device.

The layers' ``forward`` is replaced on the instance, so module hooks (FSDP2, PEFT, Lightning) stay
outside the checkpoint and the state dict is unchanged.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import save_on_cpu
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from lit_memtrain.models.layers import wrap_forwards

__all__ = ["apply_checkpointing", "attention_ops"]

_MARKER = "_lit_memtrain_checkpointed"


def attention_ops() -> list[torch._ops.OpOverload]:
    """The attention kernels whose outputs selective checkpointing keeps.

    flash-attn's ops exist only once ``flash_attn`` has been imported, so they are looked up at call time.
    """
    aten = torch.ops.aten
    ops = [
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_cudnn_attention.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
    ]
    for name in ("_flash_attn_forward", "_flash_attn_varlen_forward"):
        op = getattr(torch.ops.flash_attn, name, None)
        if op is not None:
            ops.append(op.default)
    return ops


def _draws_random_numbers(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether this call of an attention kernel applies dropout (a ``dropout_p`` above 0, read by the op's schema)."""
    for index, argument in enumerate(func._schema.arguments):
        if argument.name == "dropout_p":
            value = kwargs.get("dropout_p", args[index] if index < len(args) else argument.default_value)
            return bool(value)
    return False


def _keeps_deterministic(ops: list[torch._ops.OpOverload]) -> Callable[..., CheckpointPolicy]:
    """The selective policy: keep the outputs of ``ops``, but not of a call that applies dropout.

    Why: a kept op does not run again when backward recomputes the layer, so the random numbers it drew in forward
    are not drawn again, and every later random op of the layer (the residual or LoRA dropout after attention) draws
    from another point of the generator than in forward: other masks, gradients of another function than the loss,
    silently (CUDA's flash, memory-efficient and cuDNN kernels apply attention dropout themselves). Recomputed, the
    attention redraws its own mask from the restored generator, as full checkpointing does.
    """

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if func in ops and not _draws_random_numbers(func, args, kwargs):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _checkpointed(forward: Callable[..., Any], *, selective: bool, offload: bool) -> Callable[..., Any]:
    options: dict[str, Any] = {"use_reentrant": False}
    if selective:
        policy = _keeps_deterministic(attention_ops())
        options["context_fn"] = functools.partial(create_selective_checkpoint_contexts, policy)
    pin_memory = torch.cuda.is_available()

    @functools.wraps(forward)
    def checkpointed_forward(*args: Any, **kwargs: Any) -> Any:
        if not offload:
            return checkpoint(forward, *args, **options, **kwargs)
        with save_on_cpu(pin_memory=pin_memory):
            return checkpoint(forward, *args, **options, **kwargs)

    setattr(checkpointed_forward, _MARKER, True)
    return checkpointed_forward


def apply_checkpointing(
    layers: Iterable[nn.Module], *, selective: bool = False, offload: bool = False
) -> Callable[[], None]:
    """Run every layer of ``layers`` under non-reentrant activation checkpointing.

    Args:
        layers: the decoder layers (see :func:`lit_memtrain.models.layers.find_decoder_layers`).
        selective: also keep the attention kernels' outputs instead of recomputing attention in backward.
        offload: hold each layer's checkpointed input in host memory (pinned when CUDA is available).

    Returns:
        A function that restores the layers' original ``forward``.

    Raises:
        ValueError: a layer is already checkpointed (by this function or by transformers'
            ``gradient_checkpointing_enable``); checkpointing it twice would recompute it twice.

    Example:
        >>> restore = apply_checkpointing(find_decoder_layers(model), selective=True)  # doctest: +SKIP
    """
    layers = list(layers)
    for index, layer in enumerate(layers):
        if getattr(layer, "gradient_checkpointing", False) or getattr(layer.forward, _MARKER, False):
            raise ValueError(
                f"Decoder layer {index} ({type(layer).__name__}) is already checkpointed. Apply checkpointing "
                "once: disable transformers' gradient checkpointing (model.gradient_checkpointing_disable()) "
                "or restore the earlier apply_checkpointing first."
            )
    return wrap_forwards(layers, lambda _, forward: _checkpointed(forward, selective=selective, offload=offload))
