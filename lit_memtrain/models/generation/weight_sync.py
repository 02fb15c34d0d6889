"""The trained model's weights as a separate inference engine loads them: full tensors, checkpoint names, LoRA merged.

Why: vLLM keeps its own copy of the weights (in this process, or in a server) and loads them by the names of a
Hugging Face checkpoint (``model.layers.0.self_attn.q_proj.weight``). The trained model differs from a checkpoint
in three ways, each handled here without changing the model:

- **A LoRA adapter** (PEFT): names carry ``base_model.model.`` and ``.base_layer``, and the adapter's ``lora_A`` /
  ``lora_B`` exist in no checkpoint. Each adapted weight is sent merged, ``W + scaling * B @ A`` (computed in fp32,
  then cast to ``W``'s dtype), under its base name; the adapter's own tensors are not sent. TRL merges in place
  (``merge_adapter`` then ``unmerge_adapter``); merging out of place leaves the trained weights bit for bit as they
  were, which merging and unmerging a bf16 weight in place does not.
- **FSDP2**: every parameter is a ``DTensor`` shard. It is gathered (``full_tensor``, a collective) only when
  :meth:`InferenceWeight.materialize` is called, one tensor at a time, so that no rank holds more than one full
  tensor at once; every rank must materialize the same weights in the same order.
- **Tied embeddings**: ``named_parameters`` lists the shared tensor once, under the embedding's name, which is
  what vLLM's ``load_weights`` expects of a model with ``tie_word_embeddings``.
- **A layout other than the checkpoint's**: transformers 5 fuses a mixture-of-experts layer's experts into 3-D
  tensors (``mlp.experts.gate_up_proj``), which no checkpoint names and vLLM's ``load_weights`` refuses; such a
  tensor is sent as the checkpoint's tensors it splits into (``mlp.experts.0.gate_proj.weight``...), by transformers'
  own reverse conversion (``revert_weight_conversion``, what ``save_pretrained`` writes), gathered once for all.

The shapes and dtypes are known before anything is gathered (:class:`InferenceWeight`), as a vLLM server must be
told them before the first tensor arrives. Refused, with an error saying why: quantized bases (QLoRA), DoRA, LoRA
with a bias or on a layer that is not linear, PEFT's ``modules_to_save``, and an adapter on an LM head tied to the
embeddings (the merged head would differ from the embedding the engine ties it to).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lit_memtrain.models.lora import is_peft_model

try:  # transformers >= 5 (earlier versions keep every tensor in its checkpoint layout)
    from transformers.core_model_loading import revert_weight_conversion
except ImportError:  # pragma: no cover
    revert_weight_conversion = None

__all__ = ["InferenceWeight", "inference_weights", "materialized"]

_QUANTIZED = ("Linear4bit", "Linear8bitLt", "Params4bit", "Int8Params")
_PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True, eq=False)
class _Delta:
    """One active LoRA adapter of a linear layer: its update is ``scaling * B @ A`` (transposed with
    ``fan_in_fan_out``, where the base stores its weight as ``[in, out]``)."""

    lora_a: Tensor
    lora_b: Tensor
    scaling: float
    fan_in_fan_out: bool


@dataclass(frozen=True, eq=False)
class _Conversion:
    """A trained tensor held in another layout than the checkpoint's: ``model``'s conversion mapping turns it (named
    ``trained_name``) into the checkpoint's tensors."""

    model: nn.Module
    trained_name: str

    def pieces(self, tensor: Tensor) -> dict[str, Tensor]:
        return {name: piece.contiguous() for name, piece in revert_weight_conversion(
            self.model, {self.trained_name: tensor}).items()}  # fmt: skip


@dataclass(frozen=True, eq=False)
class InferenceWeight:
    """One tensor an inference engine loads: its checkpoint name, full shape and dtype, and how to build it.

    Attributes:
        name: the Hugging Face checkpoint name (``model.layers.0.mlp.up_proj.weight``).
        shape: the full (unsharded) shape.
        dtype: the dtype it is sent in (the trained parameter's).
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    source: Tensor
    deltas: tuple[_Delta, ...] = ()
    conversion: _Conversion | None = None

    def materialize(self, device: torch.device) -> Tensor:
        """The full tensor on ``device``, LoRA merged (a collective under FSDP2: every rank calls it together); of a
        tensor in another layout, this weight's piece (:func:`materialized` gathers such a tensor once for all)."""
        merged = self.merged_source(device)
        return merged if self.conversion is None else self.conversion.pieces(merged)[self.name]

    def merged_source(self, device: torch.device) -> Tensor:
        """The trained tensor this weight is read from, full, LoRA merged."""
        weight = _full(self.source, device)
        if not self.deltas:
            return weight
        merged = weight.float()
        for delta in self.deltas:
            update = _full(delta.lora_b, device).float() @ _full(delta.lora_a, device).float()
            merged = merged + (update.T if delta.fan_in_fan_out else update) * delta.scaling
        return merged.to(self.dtype)


def _full(tensor: Tensor, device: torch.device) -> Tensor:
    tensor = tensor.detach()
    return tensor.to(device).full_tensor() if isinstance(tensor, DTensor) else tensor.to(device)


def _refuse_quantized(model: nn.Module) -> None:
    for name, module in model.named_modules():
        kinds = {type(module).__name__, *(type(p).__name__ for p in module.parameters(recurse=False))}
        if kinds & set(_QUANTIZED):
            raise ValueError(
                f"{name} holds quantized (bitsandbytes) weights: a vLLM engine cannot be given a QLoRA model's weights. "
                "Train without lora.quantize, or generate with generation_backend='transformers'."
            )


def _lora_deltas(model: nn.Module) -> tuple[dict[str, tuple[_Delta, ...]], set[str]]:
    """For a PEFT model: the LoRA updates of each adapted base weight (by its parameter name), and the names of the
    adapters' own parameters (not sent)."""
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.lora import LoraLayer

    if any(".modules_to_save." in name for name, _ in model.named_parameters()):
        raise ValueError("PEFT's modules_to_save have no counterpart in a vLLM engine's weights; they are not supported.")
    head = model.get_output_embeddings()
    deltas: dict[str, tuple[_Delta, ...]] = {}
    adapter_parameters: set[str] = set()
    for prefix, layer in model.named_modules():
        if not isinstance(layer, LoraLayer):
            continue
        if not isinstance(layer, LoraLinear):
            raise ValueError(f"{prefix} is a {type(layer).__name__}: only LoRA on linear layers can be merged for vLLM.")
        adapter_parameters |= {f"{prefix}.{n}" for n, _ in layer.named_parameters() if not n.startswith("base_layer.")}
        if layer.disable_adapters or layer.merged:  # the base weight is what the layer computes with
            continue
        active = []
        for adapter in layer.active_adapters:
            if adapter not in layer.lora_A:
                continue
            if layer.use_dora.get(adapter) or getattr(layer, "lora_bias", {}).get(adapter):
                raise ValueError(f"{prefix}: DoRA and LoRA biases cannot be merged for vLLM; use plain LoRA.")
            active.append(_Delta(layer.lora_A[adapter].weight, layer.lora_B[adapter].weight,
                                 float(layer.scaling[adapter]), bool(layer.fan_in_fan_out)))  # fmt: skip
        if active and layer is head and layer.base_layer.weight is model.get_input_embeddings().weight:
            raise ValueError(
                "The LoRA adapter on the LM head changes a weight tied to the input embeddings: a vLLM engine ties the "
                "two and could not hold the merged head. Train without lora.lm_head, or untie the embeddings."
            )
        deltas[f"{prefix}.base_layer.weight"] = tuple(active)
    return deltas, adapter_parameters


def inference_weights(model: nn.Module) -> list[InferenceWeight]:
    """Every tensor of ``model`` an inference engine loads, under checkpoint names, LoRA merged (nothing gathered yet).

    Args:
        model: a Hugging Face causal LM, possibly a PEFT LoRA model, possibly sharded with FSDP2.

    Raises:
        ValueError: what cannot be expressed as checkpoint weights (see the module docstring), naming it.
    """
    _refuse_quantized(model)
    peft = is_peft_model(model)
    deltas, adapter_parameters = _lora_deltas(model) if peft else ({}, set())
    base = model.get_base_model() if peft else model
    weights = []
    for name, parameter in model.named_parameters():
        if name in adapter_parameters:
            continue
        checkpoint_name = name.removeprefix(_PEFT_PREFIX).replace(".base_layer.", ".") if peft else name
        pieces = _checkpoint_pieces(base, checkpoint_name, parameter)
        if pieces is None:
            weights.append(InferenceWeight(checkpoint_name, tuple(parameter.shape), parameter.dtype, parameter,
                                           deltas.get(name, ())))  # fmt: skip
            continue
        conversion = _Conversion(base, checkpoint_name)
        weights += [
            InferenceWeight(piece_name, tuple(piece.shape), piece.dtype, parameter, deltas.get(name, ()), conversion)
            for piece_name, piece in pieces.items()
        ]
    return weights


def _checkpoint_pieces(model: nn.Module, name: str, parameter: Tensor) -> dict[str, Tensor] | None:
    """The checkpoint's tensors (on the meta device) that the trained tensor ``name`` is held in place of, or None
    when it is the checkpoint's own."""
    if revert_weight_conversion is None or not hasattr(model, "config"):
        return None
    shaped = torch.empty(tuple(parameter.shape), dtype=parameter.dtype, device="meta")
    pieces = revert_weight_conversion(model, {name: shaped})
    return None if list(pieces) == [name] else pieces


def materialized(weights: list[InferenceWeight], device: torch.device) -> Iterator[tuple[str, Tensor]]:
    """``(name, full tensor)`` of each of ``weights`` in order, one at a time (the stream an engine loads); a tensor
    held in another layout than the checkpoint's is gathered once for the checkpoint tensors it splits into."""
    conversion, pieces = None, {}
    for weight in weights:
        if weight.conversion is None:
            yield weight.name, weight.materialize(device)
            continue
        if weight.conversion is not conversion:
            conversion, pieces = weight.conversion, weight.conversion.pieces(weight.merged_source(device))
        yield weight.name, pieces.pop(weight.name)
