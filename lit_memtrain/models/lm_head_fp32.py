"""An LM head that computes its logits in fp32 in a bf16 / fp16 model (TRL's ``cast_lm_head_to_fp32``).

Why: the ScaleRL recipe TRL follows keeps the LM head in fp32 so that the log-probabilities whose ratios the RL
loss compares are not rounded to bf16 logits first; the rest of the model keeps its precision. The head's weights
become fp32 and its forward computes ``hidden.float() @ weight.T`` with autocast off, in generation and in the
``nll`` loss (the chunked log-probabilities, which never call the head, do the same where the option is set).

Example:
    >>> cast_lm_head_to_fp32(model)  # doctest: +SKIP
    >>> model(input_ids).logits.dtype  # doctest: +SKIP
    torch.float32
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["cast_lm_head_to_fp32"]


def cast_lm_head_to_fp32(model: nn.Module) -> None:
    """Make ``model``'s LM head fp32 (weights and computation), as TRL's ``cast_lm_head_to_fp32``.

    Raises:
        ValueError: a LoRA adapter on the head, or a head tied to the input embeddings (TRL supports untied heads
            only), naming the setting to change.
    """
    head = model.get_output_embeddings()
    if hasattr(head, "base_layer"):
        raise ValueError(
            "cast_lm_head_to_fp32=True is not supported when the LM head carries a LoRA adapter (lora.lm_head=true), "
            "as in TRL. Set lora.lm_head=false, or cast_lm_head_to_fp32=False."
        )
    if getattr(model.config.get_text_config(), "tie_word_embeddings", False):
        raise ValueError(
            "cast_lm_head_to_fp32=True needs an LM head untied from the input embeddings (TRL supports only "
            "tie_word_embeddings=False); this model ties them. Set cast_lm_head_to_fp32=False."
        )
    head.float()

    def forward(hidden: Tensor) -> Tensor:
        with torch.autocast(hidden.device.type, enabled=False):
            return F.linear(hidden.float(), head.weight, head.bias)

    head.forward = forward
