"""LoRA and QLoRA through PEFT: settings, wrapping, the effective LM-head weight and merged exports.

Why here and not in user code: the chunked loss reads the LM-head weight directly instead of calling the
head, so an adapter on the head must be folded into that weight (``W + B A * scale``, differentiable in A
and B); and exports must merge the adapter into a plain Hugging Face model.
"""

from __future__ import annotations

import copy
import importlib.util
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel


@dataclass
class LoraSettings:
    """LoRA hyper-parameters (YAML: ``model.lora: {r: 16, alpha: 32}``).

    Args:
        r: adapter rank.
        alpha: scaling numerator (the update is ``alpha / r * B A``).
        dropout: dropout on the adapter input.
        target_modules: ``"all-linear"`` (every linear layer but the LM head) or a list of module names.
        lm_head: also adapt the LM head.
        quantize: ``"4bit"`` (QLoRA, NF4) or ``"8bit"`` base weights through bitsandbytes; CUDA only.
    """

    r: int = 16
    alpha: int = 32
    dropout: float = 0.0
    target_modules: str | list[str] = "all-linear"
    lm_head: bool = False
    quantize: Literal["4bit", "8bit"] | None = None

    def __post_init__(self) -> None:
        if self.r < 1 or self.alpha <= 0:
            raise ValueError(f"LoRA needs r >= 1 and alpha > 0, got r={self.r}, alpha={self.alpha}.")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {self.dropout}.")
        if self.quantize not in (None, "4bit", "8bit"):
            raise ValueError(f"quantize must be '4bit', '8bit' or None, got {self.quantize!r}.")


# Hyper-parameters saved in checkpoints hold LoraSettings: allow it in torch.load(weights_only=True), which
# lit-memtrain export uses and Lightning's resume does by default (torch >= 2.6).
torch.serialization.add_safe_globals([LoraSettings, (LoraSettings, "lit_memtrain.lora.LoraSettings")])


def check_quantization_available(settings: LoraSettings) -> None:
    """Raise a clear error when QLoRA cannot run here (no CUDA, or no bitsandbytes)."""
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"lora.quantize={settings.quantize!r} (QLoRA) needs a CUDA GPU: bitsandbytes quantized weights do not "
            "train on this machine. Drop lora.quantize to train a plain LoRA adapter."
        )
    if importlib.util.find_spec("bitsandbytes") is None:
        raise RuntimeError("QLoRA needs bitsandbytes: pip install 'lit-memtrain[quant]'.")


def quantization_config(settings: LoraSettings, compute_dtype: torch.dtype):
    """A ``BitsAndBytesConfig`` for QLoRA, after checking that CUDA and bitsandbytes are there."""
    check_quantization_available(settings)
    from transformers import BitsAndBytesConfig

    if settings.quantize == "4bit":
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=compute_dtype,
        )
    return BitsAndBytesConfig(load_in_8bit=True)


def _target_modules(model: nn.Module, settings: LoraSettings) -> str | list[str]:
    if not settings.lm_head:
        return settings.target_modules
    if settings.target_modules != "all-linear":
        return [*settings.target_modules, "lm_head"]
    return sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)})


def apply_lora(model: PreTrainedModel, settings: LoraSettings, task_type: str = "CAUSAL_LM") -> nn.Module:
    """Wrap ``model`` in a PEFT LoRA model; only the adapter weights train (and, with PEFT's ``task_type="SEQ_CLS"``
    for a sequence-classification model, its whole ``score`` head)."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    if settings.quantize:
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    config = LoraConfig(
        r=settings.r,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=_target_modules(model, settings),
        task_type=task_type,
    )
    return get_peft_model(model, config)


def is_peft_model(model: nn.Module) -> bool:
    from peft import PeftModel

    return isinstance(model, PeftModel)


def head_weight(head: nn.Module) -> tuple[Tensor, Tensor | None]:
    """Weight and bias the LM head applies, with active LoRA adapters folded in (differentiably)."""
    base = getattr(head, "base_layer", None)
    if base is None:
        return head.weight, head.bias
    weight = base.weight
    if not head.disable_adapters and not head.merged:
        for name in head.active_adapters:
            if name not in head.lora_A:
                continue
            if head.use_dora.get(name):
                raise ValueError("DoRA adapters on the LM head are not supported by the chunked loss; use loss_type='nll'.")
            dropout = head.lora_dropout[name]
            if isinstance(dropout, nn.Dropout) and dropout.p > 0 and head.training:
                raise ValueError(
                    "A LoRA adapter with dropout on the LM head cannot be folded into the chunked loss. "
                    "Set lora.dropout=0, lora.lm_head=false, or loss_type='nll'."
                )
            weight = weight + head.get_delta_weight(name)
    return weight, base.bias


def merged_copy(model: nn.Module, unquantized_base: PreTrainedModel | None = None) -> PreTrainedModel:
    """A plain Hugging Face model with the adapter merged in, in host memory; the training model is left untouched.

    The copy is made tensor by tensor into host memory (never a second copy on the training device, which at
    the end of a long run has no room for one) and merged there. For QLoRA pass ``unquantized_base`` (the base
    reloaded in a float dtype, in host memory): the adapter is merged into it rather than into 4/8-bit
    weights, which would lose precision.
    """
    if not is_peft_model(model):
        return model
    if unquantized_base is None:
        target = host_copy(model)
    else:
        from peft import get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict

        target = get_peft_model(unquantized_base, model.peft_config["default"])
        adapter = {name: tensor.detach().cpu() for name, tensor in get_peft_model_state_dict(model).items()}
        set_peft_model_state_dict(target, adapter)
    _untie_adapted_head(target)
    return target.merge_and_unload()


def host_copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` whose parameters, buffers and tensor attributes are new host-memory tensors.

    ``copy.deepcopy`` would clone every tensor on its own device; here each is copied to the CPU first and
    handed to ``deepcopy`` through its memo, so tied weights stay tied and nothing is allocated on the device.
    """
    memo: dict[int, object] = {}
    for module in model.modules():
        tensors = [*module._parameters.values(), *module._buffers.values()]
        tensors += [value for value in vars(module).values() if isinstance(value, Tensor)]
        for tensor in tensors:
            if tensor is None or id(tensor) in memo:
                continue
            on_host = tensor.detach().to("cpu", copy=True)
            if isinstance(tensor, nn.Parameter):
                on_host = nn.Parameter(on_host, requires_grad=tensor.requires_grad)
            memo[id(tensor)] = on_host
    return copy.deepcopy(model, memo)


def _untie_adapted_head(model: nn.Module) -> None:
    """Give an adapted LM head its own weight, so merging does not also change the tied input embeddings."""
    head = model.get_output_embeddings()
    base = getattr(head, "base_layer", None)
    if base is None or base.weight is not model.get_input_embeddings().weight:
        return
    base.weight = nn.Parameter(base.weight.detach().clone(), requires_grad=False)
    config = model.get_base_model().config
    config.tie_word_embeddings = False
    if hasattr(config, "get_text_config"):
        config.get_text_config().tie_word_embeddings = False
