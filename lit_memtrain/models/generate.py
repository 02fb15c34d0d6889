"""Answers from an exported Hugging Face directory or a GGUF file, for a quick look at a trained model.

Greedy by default; ``temperature > 0`` samples (with ``top_p`` nucleus filtering). Works with whatever
tokenizer the directory ships: inputs the model's ``forward`` does not name (``token_type_ids`` from a
WordPiece tokenizer, for example) are dropped before ``generate``, which would refuse them.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from lit_memtrain.datamodules.gguf_files import find_gguf
from lit_memtrain.datamodules.hub_access import require_hub
from lit_memtrain.datamodules.tokenize import encode_prompt
from lit_memtrain.datamodules.tokenizer import load_tokenizer
from lit_memtrain.models.builder import ModelRecipe, build_causal_lm
from lit_memtrain.models.generation.sharded import unsharded_for_generation

__all__ = [
    "end_of_sequence_ids", "generate_answer", "greedy_completions", "load_model_for", "load_tokenizer_for",
    "model_inputs", "prompt_token_ids",
]


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")


def load_model_for(model: str, gguf_file: str | None = None) -> PreTrainedModel:
    """The causal LM in ``model`` (a directory or hub id, with ``gguf_file`` the GGUF file in it; a ``.gguf`` path; a
    packaged GGUF model's short name), in eval mode and the dtype it was saved in."""
    init_kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    recipe = ModelRecipe(model=model, dtype="auto", attn_implementation=None, model_init_kwargs=init_kwargs)
    return build_causal_lm(recipe).eval()


def load_tokenizer_for(
    model_dir: str, tokenizer: str | None = None, gguf_file: str | None = None
) -> PreTrainedTokenizerBase:
    """The tokenizer saved in ``model_dir`` or in its GGUF file (``gguf_file``, or ``model_dir`` a ``.gguf`` path or a
    packaged model's name), or ``tokenizer`` (a directory, hub id or GGUF file), with a clear error when there is
    none (``AutoTokenizer`` would otherwise build an empty one from the model's config)."""
    if tokenizer is None and find_gguf(model_dir, gguf_file) is not None:
        return load_tokenizer(model_dir, gguf_file)
    if tokenizer is not None and find_gguf(tokenizer) is not None:
        return load_tokenizer(tokenizer)
    source = tokenizer or model_dir
    hint = (
        "Export the model with its tokenizer (CausalLMModule(tokenizer=...) or tokenizer.save_pretrained(dir)), "
        "or name one with --tokenizer."
    )
    if Path(source).is_dir() and not any((Path(source) / name).exists() for name in _TOKENIZER_FILES):
        raise ValueError(f"{source!r} has no tokenizer (none of {', '.join(_TOKENIZER_FILES)}). {hint}")
    require_hub(source, "tokenizer")
    try:
        loaded = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError, TypeError, KeyError) as error:
        raise ValueError(f"No usable tokenizer in {source!r} ({type(error).__name__}: {error}). {hint}") from error
    if len(loaded) == 0:
        raise ValueError(f"The tokenizer loaded from {source!r} has an empty vocabulary. {hint}")
    return loaded


def model_inputs(model: PreTrainedModel, encoded: dict[str, Any]) -> dict[str, Any]:
    """``encoded`` without the entries the model's ``forward`` does not name (``input_ids`` is always kept)."""
    accepted = {
        name
        for name, parameter in inspect.signature(model.forward).parameters.items()
        if parameter.kind not in (parameter.VAR_KEYWORD, parameter.VAR_POSITIONAL)
    }
    return {key: value for key, value in encoded.items() if key in accepted or key == "input_ids"}


def end_of_sequence_ids(tokenizer: PreTrainedTokenizerBase, model: Any) -> list[int]:
    """Every token id that ends a completion: the tokenizer's end of sequence and those of the model's
    ``generation_config`` (an end-of-turn token: Gemma's ``<end_of_turn>``, Llama 3's ``<|eot_id|>``), as TRL takes them.

    Why both: ``generate`` given ``eos_token_id`` stops at those alone, and a chat model's turn often ends with a token
    other than the tokenizer's eos; a completion generated past it carries the next turn, and an answer checked
    exactly is scored wrong.
    """
    ids = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for token in [configured] if isinstance(configured, int) else list(configured or []):
        if token not in ids:
            ids.append(token)
    return ids


def generate_answer(
    model_dir: str | PreTrainedModel,
    prompt: str,
    max_new_tokens: int = 32,
    temperature: float = 0.0,
    top_p: float = 1.0,
    tokenizer: str | PreTrainedTokenizerBase | None = None,
    seed: int | None = None,
    gguf_file: str | None = None,
) -> str:
    """Answer ``prompt`` with the model in ``model_dir`` (chat template when the tokenizer has one, else the prompt
    with the special tokens training puts before it: :func:`prompt_token_ids`).

    ``model_dir`` and ``tokenizer`` may be a model and tokenizer loaded already (:func:`load_model_for`,
    :func:`load_tokenizer_for`), to answer several prompts without reading the weights again.

    Args:
        temperature: 0 decodes greedily; above 0, samples at this temperature.
        top_p: nucleus sampling: sample among the most likely tokens whose probabilities sum to ``top_p``.
        tokenizer: a tokenizer directory or hub id, when ``model_dir`` has none.
        seed: seeds the sampling, for reproducible answers.
        gguf_file: the GGUF file in ``model_dir`` to read model and tokenizer from (:func:`load_model_for`).
    """
    if temperature < 0 or not 0 < top_p <= 1:
        raise ValueError(f"temperature must be >= 0 and top_p in (0, 1], got {temperature} and {top_p}.")
    if isinstance(tokenizer, PreTrainedTokenizerBase):
        loaded = tokenizer
    else:
        loaded = load_tokenizer_for(model_dir, tokenizer, gguf_file)
    model = model_dir if isinstance(model_dir, PreTrainedModel) else load_model_for(model_dir, gguf_file)
    conversation = [{"role": "user", "content": prompt}] if loaded.chat_template else prompt
    inputs = model_inputs(model, _left_padded([prompt_token_ids(loaded, conversation)], 0, model.device))
    sampling = {"do_sample": True, "temperature": temperature, "top_p": top_p} if temperature > 0 else {"do_sample": False}
    if seed is not None:
        torch.manual_seed(seed)
    pad_token_id = loaded.pad_token_id if loaded.pad_token_id is not None else loaded.eos_token_id
    with torch.no_grad():
        output = model.generate(
            **inputs,
            max_new_tokens=max_new_tokens,
            eos_token_id=end_of_sequence_ids(loaded, model),
            pad_token_id=pad_token_id,
            **sampling,
        )
    return loaded.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)


def prompt_token_ids(
    tokenizer: PreTrainedTokenizerBase,
    prompt: str | list[dict[str, Any]],
    chat_template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """The token ids a model trained by lit-memtrain is prompted with: a conversation rendered with the chat template,
    its generation prompt and ``chat_template_kwargs`` (the template writes its own special tokens), a plain string
    with the special tokens training put before it (:func:`~lit_memtrain.datamodules.tokenize.encode_prompt`: a Llama
    tokenizer's BOS)."""
    if isinstance(prompt, str):
        return encode_prompt(tokenizer, prompt)
    text = tokenizer.apply_chat_template(
        prompt, tokenize=False, add_generation_prompt=True, **(chat_template_kwargs or {})
    )
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


@torch.no_grad()
def greedy_completions(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str | list[dict[str, Any]]],
    max_new_tokens: int,
    batch_size: int = 32,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> list[str]:
    """The greedy completion of each prompt (a conversation, rendered with the chat template and its generation
    prompt, or a plain string with the special tokens training put before it: :func:`prompt_token_ids`), ended at
    any of :func:`end_of_sequence_ids`, decoded without special tokens, generated ``batch_size`` prompts at a time.

    Prompts are padded on the left, so that every row's completion starts where its prompt ends; the attention mask
    keeps the padding out, and the answers equal those of each prompt generated alone. The model is left in the mode
    it was in. ``chat_template_kwargs`` go to the chat template, as the fit's (``PromptDataModule``'s
    ``{"enable_thinking": False}``) went. A model sharded with FSDP2 (every rank generating the same prompts, as ``ExactAnswerAccuracy`` does)
    has its root parameters gathered first (:func:`~lit_memtrain.models.generation.sharded.unsharded_for_generation`):
    ``generate`` of a LoRA model never enters the root's forward, where FSDP2 gathers them.
    """
    token_ids = [prompt_token_ids(tokenizer, prompt, chat_template_kwargs) for prompt in prompts]
    pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    was_training = model.training
    model.eval()
    completions = []
    try:
        for start in range(0, len(token_ids), batch_size):
            encoded = _left_padded(token_ids[start : start + batch_size], pad_token_id, model.device)
            with unsharded_for_generation(model, gather_all=False) as synced_gpus:
                output = model.generate(
                    **model_inputs(model, dict(encoded)), max_new_tokens=max_new_tokens, do_sample=False,
                    eos_token_id=end_of_sequence_ids(tokenizer, model), pad_token_id=pad_token_id,
                    synced_gpus=synced_gpus,
                )  # fmt: skip
            new_tokens = output[:, encoded["input_ids"].shape[1] :]
            completions += tokenizer.batch_decode(new_tokens, skip_special_tokens=True)
    finally:
        model.train(was_training)
    return completions


def _left_padded(token_ids: list[list[int]], pad_token_id: int, device: torch.device) -> dict[str, torch.Tensor]:
    """``input_ids`` and ``attention_mask`` of prompts padded on the left to the longest."""
    length = max(len(ids) for ids in token_ids)
    input_ids = torch.tensor([[pad_token_id] * (length - len(ids)) + ids for ids in token_ids], device=device)
    mask = torch.tensor([[0] * (length - len(ids)) + [1] * len(ids) for ids in token_ids], device=device)
    return {"input_ids": input_ids, "attention_mask": mask}
