"""A preset keeps its own vocabulary whatever tokenizer the run reads (issue 22, point 6).

The tokenizer must fit inside the vocabulary: a smaller one is fine (real models pad their vocabulary past their
tokenizer), a larger one is refused with both sizes and the override that fixes it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from lit_memtrain.datamodules.tokenizer import load_tokenizer
from lit_memtrain.models.builder import ModelRecipe, causal_lm_config
from lit_memtrain.models.presets import PRESETS
from lit_memtrain.objectives.causal_lm import CausalLMModule

EMBEDDED = "lit-memtrain/embedded"  # 384 tokens, pad 0, eos 2
SMALL = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
         "num_key_value_heads": 1, "head_dim": 16}  # fmt: skip


def _built(**arguments) -> CausalLMModule:
    module = CausalLMModule(tokenizer=EMBEDDED, **arguments)
    module.configure_model()
    return module


@pytest.fixture(scope="module")
def large_tokenizer(tmp_path_factory) -> str:
    """The embedded tokenizer grown to 600 tokens: more than the tiny presets' vocabulary of 512."""
    tokenizer = load_tokenizer(EMBEDDED)
    tokenizer.add_tokens([f"<extra_{index}>" for index in range(600 - len(tokenizer))])
    directory = tmp_path_factory.mktemp("tokenizer")
    tokenizer.save_pretrained(directory)
    return str(directory)


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-llama"])
def test_a_preset_keeps_its_vocabulary_with_a_smaller_tokenizer(preset):
    model = _built(preset=preset, config_overrides=SMALL).model
    assert model.get_input_embeddings().num_embeddings == model.config.vocab_size == PRESETS[preset]["vocab_size"]
    assert model.get_output_embeddings().out_features == 512
    assert (model.config.pad_token_id, model.config.eos_token_id) == (0, 2)  # special ids still the tokenizer's


def test_a_published_preset_plans_and_builds_with_its_published_vocabulary():
    tokenizer = load_tokenizer(EMBEDDED)
    assert causal_lm_config(ModelRecipe(preset="qwen3-4b"), tokenizer).vocab_size == 151_936
    assert causal_lm_config(ModelRecipe(preset="llama-3.1-8b"), tokenizer).vocab_size == 128_256


def test_a_tokenizer_larger_than_the_preset_vocabulary_is_refused_before_the_model_is_built(large_tokenizer):
    module = CausalLMModule(preset="tiny-qwen3", config_overrides=SMALL, tokenizer=large_tokenizer)
    with pytest.raises(ValueError) as refused:
        module.configure_model()
    assert str(refused.value) == (
        "The tokenizer has 600 tokens but the model's embedding has only 512 rows (the vocabulary of preset "
        "'tiny-qwen3'), so some token ids would index past it. Use the tokenizer of the model you mean to train, "
        "or set config_overrides.vocab_size to at least 600."
    )
    assert module.model is None
    overrides = {**SMALL, "vocab_size": 600}
    grown = CausalLMModule(preset="tiny-qwen3", config_overrides=overrides, tokenizer=large_tokenizer)
    grown.configure_model()
    assert grown.model.get_input_embeddings().num_embeddings == 600


def test_an_override_smaller_than_the_tokenizer_is_named_in_the_refusal():
    with pytest.raises(ValueError, match=r"has only 64 rows \(config_overrides.vocab_size\)"):
        _built(preset="tiny-qwen3", config_overrides={**SMALL, "vocab_size": 64})


def test_a_config_dict_keeps_its_vocabulary_or_takes_the_tokenizer_length_when_it_names_none():
    shape = {"model_type": "qwen3", **SMALL}
    assert _built(config=shape).model.config.vocab_size == len(load_tokenizer(EMBEDDED)) == 384
    assert _built(config={**shape, "vocab_size": 1000}).model.config.vocab_size == 1000
    with pytest.raises(ValueError, match=r"has 384 tokens but the model's embedding has only 100 rows \(the config's"):
        _built(config={**shape, "vocab_size": 100})


def test_the_quickstart_preset_fits_the_embedded_tokenizer():
    import yaml

    quickstart = yaml.safe_load(Path("configs/quickstart.yaml").read_text())
    preset, tokenizer = quickstart["model"]["preset"], quickstart["data"]["tokenizer"]
    assert len(load_tokenizer(tokenizer)) <= PRESETS[preset]["vocab_size"]


def test_an_export_of_a_preset_run_reloads_with_the_demo_tokenizer_it_holds(tmp_path):
    """The export keeps the preset's 512 rows beside the 384-token demo tokenizer: the pairing is still accepted."""
    exported = _built(preset="tiny-qwen3", config_overrides=SMALL).export(tmp_path / "export")
    reloaded = _built(model=str(exported))
    assert reloaded.model.get_input_embeddings().num_embeddings == 512
    reloaded.model.save_pretrained(tmp_path / "weights-only")
    with pytest.raises(ValueError, match="which it was not trained with .its directory does not hold that tokenizer"):
        _built(model=str(tmp_path / "weights-only"))
