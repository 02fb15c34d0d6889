"""Greedy generation from an exported Hugging Face directory, for a quick look at a trained model."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def generate_answer(model_dir: str, prompt: str, max_new_tokens: int = 32) -> str:
    """Answer ``prompt`` with the model in ``model_dir`` (chat template when the tokenizer has one)."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.eval()
    if tokenizer.chat_template:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
    else:
        text = prompt
    inputs = tokenizer(text, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        output = model.generate(
            **inputs,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    return tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
