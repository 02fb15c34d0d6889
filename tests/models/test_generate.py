"""lit-memtrain generate: any tokenizer a model directory ships, greedy or sampled answers, a clear error
without a tokenizer."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, BertTokenizerFast

from lit_memtrain.cli import main
from lit_memtrain.models.generate import generate_answer, model_inputs
from lit_memtrain.models.presets import build_config

WORDS = "hello world how are you the a to is of and it".split()


@pytest.fixture(scope="module")
def wordpiece_model_dir(tmp_path_factory):
    """A model directory whose tokenizer (WordPiece, as BERT-style models ship) returns token_type_ids."""
    directory = tmp_path_factory.mktemp("wordpiece")
    vocab = {token: index for index, token in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS])}
    tokenizer = BertTokenizerFast(vocab=vocab)
    assert tokenizer("hello world")["token_type_ids"] == [0, 0, 0, 0]
    torch.manual_seed(0)
    overrides = {"vocab_size": len(tokenizer), "pad_token_id": 0, "bos_token_id": 2, "eos_token_id": 3}
    AutoModelForCausalLM.from_config(build_config("tiny-qwen3", overrides)).save_pretrained(directory / "model")
    tokenizer.save_pretrained(directory / "model")
    (directory / "bare").mkdir()
    AutoModelForCausalLM.from_config(build_config("tiny-qwen3", overrides)).save_pretrained(directory / "bare")
    return directory


def test_generate_works_with_a_tokenizer_that_returns_token_type_ids(wordpiece_model_dir, capsys):
    model = str(wordpiece_model_dir / "model")
    main(["generate", "--model", model, "--prompt", "hello world", "--prompt", "how are you", "--max_new_tokens", "6"])
    out = capsys.readouterr().out
    assert out.count("answer:") == 2 and "prompt: how are you" in out
    assert generate_answer(model, "hello", 6) == _argmax_answer(model, "hello", 6)


def _argmax_answer(model_dir: str, prompt: str, max_new_tokens: int) -> str:
    """Greedy decoding by hand: the most likely next token, until eos or ``max_new_tokens``."""
    tokenizer = BertTokenizerFast.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"][:, :-1]  # [CLS] prompt, as training starts a row
    prompt_length = ids.shape[1]
    with torch.no_grad():
        for _ in range(max_new_tokens):
            ids = torch.cat([ids, model(ids).logits[:, -1:].argmax(-1)], dim=1)
            if ids[0, -1] == tokenizer.sep_token_id:  # the model's eos_token_id (3)
                break
    return tokenizer.decode(ids[0, prompt_length:], skip_special_tokens=True)


def test_sampling_options_sample_and_a_seed_makes_them_reproducible(wordpiece_model_dir, capsys):
    model = str(wordpiece_model_dir / "model")
    sampled = {generate_answer(model, "hello", 8, temperature=2.0, top_p=0.95, seed=seed) for seed in range(5)}
    assert len(sampled) > 1
    assert generate_answer(model, "hello", 8, temperature=2.0, seed=3) == generate_answer(model, "hello", 8, temperature=2.0, seed=3)
    # A nucleus this small holds the most likely token alone: sampling at any temperature decodes greedily.
    assert {generate_answer(model, "hello", 8, temperature=2.0, top_p=1e-6, seed=seed) for seed in range(3)} == {
        _argmax_answer(model, "hello", 8)
    }
    main(["generate", "--model", model, "--prompt", "hello", "--temperature", "0.7", "--top_p", "0.9", "--seed", "1"])
    assert "answer:" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["generate", "--model", model, "--prompt", "hello", "--top_p", "0"])
    assert "--top_p in (0, 1]" in capsys.readouterr().err


def test_a_directory_without_a_tokenizer_is_a_clear_error(wordpiece_model_dir, capsys):
    bare = str(wordpiece_model_dir / "bare")
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--model", bare, "--prompt", "hello"])
    assert exit_info.value.code == 2
    assert f"{bare!r} has no tokenizer" in capsys.readouterr().err
    main(["generate", "--model", bare, "--tokenizer", str(wordpiece_model_dir / "model"), "--prompt", "hello"])
    assert "answer:" in capsys.readouterr().out


def test_inputs_are_kept_only_when_the_model_names_them():
    encoded = {"input_ids": torch.ones(1, 3), "attention_mask": torch.ones(1, 3), "token_type_ids": torch.zeros(1, 3)}
    qwen = AutoModelForCausalLM.from_config(build_config("tiny-qwen3"))
    assert sorted(model_inputs(qwen, encoded)) == ["attention_mask", "input_ids"]
    gpt2 = AutoModelForCausalLM.from_config(build_config({"model_type": "gpt2", "n_layer": 1, "n_embd": 16, "n_head": 2}))
    assert sorted(model_inputs(gpt2, encoded)) == ["attention_mask", "input_ids", "token_type_ids"]
