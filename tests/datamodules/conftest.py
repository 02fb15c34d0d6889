"""Offline stand-ins for two real tokenizer families, built with the ``tokenizers`` library.

- ``llama``: Llama-3 style: its post-processor adds ``<|begin_of_text|>`` as BOS to every encoded string,
  and its chat template writes ``{{ bos_token }}`` itself (so conversations must not get a second BOS);
  assistant turns are marked with ``{%- generation %}``.
- ``qwen``: Qwen style: no BOS at all, ChatML template, assistant turns marked with ``{% generation -%}``.
"""

from __future__ import annotations

import pytest

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "What is 2 + 3? It is 5.",
    "Hello there, assistant! Reverse the word abc: cba.",
    "Sort the letters of cab. They are abc.",
] * 10

LLAMA_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
    "{%- if message['role'] == 'assistant' %}{%- generation %}{{- message['content'] + '<|eot_id|>' }}{%- endgeneration %}"
    "{%- else %}{{- message['content'] + '<|eot_id|>' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}"
)
QWEN_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\n' }}"
    "{%- if message['role'] == 'assistant' %}{% generation -%}{{ message['content'] + '<|im_end|>' }}{%- endgeneration %}"
    "{%- else %}{{- message['content'] + '<|im_end|>' }}{%- endif %}{{- '\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)


def build_tokenizer(style: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    if style == "llama":
        specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    else:
        specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    bpe.train_from_iterator(_CORPUS, trainer=trainer)
    if style == "llama":
        bos = "<|begin_of_text|>"
        bpe.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bpe.token_to_id(bos))]
        )
        tokenizer = PreTrainedTokenizerFast(
            tokenizer_object=bpe, bos_token=bos, eos_token="<|eot_id|>", pad_token="<|end_of_text|>"
        )
        tokenizer.chat_template = LLAMA_TEMPLATE
    else:
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>")
        tokenizer.chat_template = QWEN_TEMPLATE
    return tokenizer


@pytest.fixture(scope="session")
def chat_tokenizers():
    return {style: build_tokenizer(style) for style in ("llama", "qwen")}
