"""A tiny GGUF file written with the ``gguf`` package's writer, as llama.cpp writes a Llama model.

Why: the GGUF tests need a file transformers reads, offline and in a second, without the 93 MB packaged model. The
file holds a small random-weight Llama (``tiny-llama``'s shape, tied embeddings) and the embedded byte-level BPE
tokenizer with its chat template: the metadata keys transformers' GGUF loader reads for the ``llama`` architecture
(``llama.*`` shape keys, ``tokenizer.ggml.*`` with ``model = gpt2``), and the tensors under llama.cpp's names, the
query and key projections permuted as llama.cpp's converter permutes them (transformers undoes it on load).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from lit_memtrain.datamodules.embedded import embedded_tokenizer_path
from lit_memtrain.models.presets import build_config

_LAYER_TENSORS = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def tiny_llama(seed: int = 0) -> PreTrainedModel:
    """The model the tiny GGUF holds: ``tiny-llama``'s shape with tied embeddings and the embedded vocabulary."""
    torch.manual_seed(seed)
    config = build_config("tiny-llama", {"tie_word_embeddings": True, "vocab_size": 384, "bos_token_id": None,
                                         "eos_token_id": 2, "pad_token_id": 0})  # fmt: skip
    return AutoModelForCausalLM.from_config(config).eval()


def _permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's reordering of a query/key projection's rows (rotary halves interleaved)."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape
    )


def write_tiny_gguf(
    path: Path,
    model: PreTrainedModel | None = None,
    architecture: str = "llama",
    tensor_type: str = "F32",
) -> Path:
    """Write ``model`` (default :func:`tiny_llama`) and the embedded tokenizer to ``path`` as a GGUF file.

    ``architecture`` is the name written to ``general.architecture`` (another than ``llama`` makes a file
    transformers cannot read); ``tensor_type`` names the ``GGMLQuantizationType`` the matrices are stored in (``F32``,
    or ``Q8_1``, which the ``gguf`` package cannot dequantize: its blocks are written as zeros).
    """
    import gguf

    model = model or tiny_llama()
    config = model.config
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name("tiny llama")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    _add_tokenizer(writer)
    matrix_type = gguf.GGMLQuantizationType[tensor_type]
    for name, tensor in _gguf_tensors(model).items():
        if tensor.ndim == 2 and matrix_type != gguf.GGMLQuantizationType.F32:
            block, block_bytes = gguf.GGML_QUANT_SIZES[matrix_type]
            raw = np.zeros((tensor.shape[0], tensor.shape[1] // block * block_bytes), dtype=np.uint8)
            writer.add_tensor(name, raw, raw_dtype=matrix_type)
        else:
            writer.add_tensor(name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _gguf_tensors(model: PreTrainedModel) -> dict[str, np.ndarray]:
    config = model.config
    weights = {name: tensor.detach().float().numpy() for name, tensor in model.state_dict().items()}
    tensors = {
        "token_embd.weight": weights["model.embed_tokens.weight"],
        "output_norm.weight": weights["model.norm.weight"],
    }
    for layer in range(config.num_hidden_layers):
        for hf_name, gguf_name in _LAYER_TENSORS.items():
            weight = weights[f"model.layers.{layer}.{hf_name}.weight"]
            if gguf_name == "attn_q":
                weight = _permute(weight, config.num_attention_heads)
            elif gguf_name == "attn_k":
                weight = _permute(weight, config.num_key_value_heads)
            tensors[f"blk.{layer}.{gguf_name}.weight"] = weight
    return tensors


def _add_tokenizer(writer) -> None:
    """The embedded tokenizer as ``tokenizer.ggml.*`` keys: byte-level BPE (``gpt2``), its merges and chat template."""
    import gguf

    directory = Path(embedded_tokenizer_path())
    spec = json.loads((directory / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    special = {token["content"]: token["id"] for token in spec["added_tokens"]}
    vocab.update(special)
    tokens = sorted(vocab, key=vocab.get)
    merges = [" ".join(merge) if isinstance(merge, list) else merge for merge in spec["model"]["merges"]]
    config = json.loads((directory / "tokenizer_config.json").read_text())
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types(
        [gguf.TokenType.CONTROL if token in special else gguf.TokenType.NORMAL for token in tokens]
    )
    writer.add_token_merges(merges)
    writer.add_eos_token_id(special["<|im_end|>"])
    writer.add_pad_token_id(special["<|endoftext|>"])
    writer.add_chat_template(config.get("chat_template") or (directory / "chat_template.jinja").read_text())
