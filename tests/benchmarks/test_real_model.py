"""``--model`` of the side-by-side benchmarks (benchmarks/real_model.py): a GGUF model saved once as the float32
directory both frameworks load, the same weights and tokenizer as the file's."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from equivalence import assert_each_equal_up_to_rounding
from gguf_writer import tiny_llama
from lit_memtrain.datamodules.tokenizer import load_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from real_model import save_real_model  # noqa: E402


def test_a_gguf_model_is_saved_as_the_float32_weights_and_tokenizer_it_holds(tiny_gguf, tmp_path):
    directory = save_real_model(str(tiny_gguf), tmp_path / "model")

    saved = AutoModelForCausalLM.from_pretrained(directory)  # a plain directory: no gguf_file, no gguf package
    assert_each_equal_up_to_rounding(saved.state_dict(), tiny_llama().state_dict(), terms=1)
    assert saved.config.tie_word_embeddings and saved.dtype.is_floating_point and saved.dtype.itemsize == 4
    tokenizer, written = AutoTokenizer.from_pretrained(directory), load_tokenizer(str(tiny_gguf))
    chat = [{"role": "user", "content": "What is 23 + 48?"}]
    assert tokenizer.apply_chat_template(chat, tokenize=False) == written.apply_chat_template(chat, tokenize=False)
    assert tokenizer("23 + 48 = 71")["input_ids"] == written("23 + 48 = 71")["input_ids"]
    assert tokenizer.eos_token_id == written.eos_token_id and tokenizer.pad_token_id == written.pad_token_id


def test_a_model_that_is_not_a_gguf_file_is_refused_with_what_is_known(tmp_path):
    expected = "'tiny-qwen3' is neither 'tiny', a packaged GGUF model .*smollm2-135m-instruct"
    with pytest.raises(ValueError, match=expected):
        save_real_model("tiny-qwen3", tmp_path / "model")
