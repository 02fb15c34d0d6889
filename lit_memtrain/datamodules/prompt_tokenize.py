"""Turning a prompt-only example into the token ids online RL generates from, cut to ``max_prompt_length``.

Why a separate module: like :mod:`~lit_memtrain.datamodules.preference_tokenize` for DPO, these are pure functions
of an example and a tokenizer, checked token by token against TRL in tests without a datamodule or a model.

Formats (TRL's prompt-only formats): a ``prompt`` column holding a string (standard: tokenized as TRL's
``GRPOTrainer`` does, ``tokenizer(text=prompt)``, so a tokenizer that adds a BOS token adds it) or a list of chat
messages (conversational: the chat template with ``add_generation_prompt=True``). Every other column is data for the
reward functions.
"""

from __future__ import annotations

from typing import Any, Literal

from lit_memtrain.datamodules.tokenize import ExampleError, required_field

__all__ = ["RESERVED_COLUMNS", "PromptTruncation", "detect_prompt_format", "tokenize_prompt"]

PromptTruncation = Literal["keep_end", "keep_start"]

RESERVED_COLUMNS = ("prompts", "completions", "completion_ids", "trainer_state", "log_metric", "log_extra")
"""Names reward functions receive as keyword arguments already: a dataset column may not take one of them."""
_NOT_PASSED = ("prompt", "completion")  # given to reward functions as prompts= and completions= (generated)


def detect_prompt_format(columns: list[str]) -> list[str]:
    """The columns passed to reward functions (all but ``prompt`` and ``completion``); a ValueError when there is
    no ``prompt`` column or a column takes a name reward functions already receive."""
    if "prompt" not in columns:
        raise ValueError(
            f"Prompt data needs a 'prompt' column (a string, or a list of chat messages); the dataset has columns "
            f"{columns}. Rename the column, or map the dataset to TRL's prompt-only format first."
        )
    reserved = [c for c in columns if c in RESERVED_COLUMNS]
    if reserved:
        raise ValueError(
            f"The dataset columns {reserved} would be passed to the reward functions under names they already "
            f"receive ({', '.join(RESERVED_COLUMNS)}); rename them."
        )
    return [c for c in columns if c not in _NOT_PASSED]


def tokenize_prompt(
    example: dict[str, Any],
    tokenizer: Any,
    max_prompt_length: int | None = None,
    prompt_truncation: PromptTruncation = "keep_end",
    chat_template_kwargs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``prompt_ids`` of one example (cut to ``max_prompt_length``) and its length before the cut (``num_tokens``).

    ``max_prompt_length`` keeps the prompt's last tokens (``keep_end``: the end of the question and the generation
    prompt, where the answer starts) or its first ones (``keep_start``). ``chat_template_kwargs`` go to the chat
    template of conversational prompts (TRL's, e.g. ``{"enable_thinking": False}``).

    Raises:
        ExampleError: a missing or empty prompt, or one that is neither a string nor a list of messages.
    """
    prompt = required_field(example, "prompt")
    if isinstance(prompt, str):
        ids = list(tokenizer(text=prompt)["input_ids"])
    elif isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt):
        if not tokenizer.chat_template:
            raise ExampleError(
                "the prompt is a list of chat messages but the tokenizer has no chat template; use a tokenizer with "
                "a chat_template (for example an instruct model's) or give prompts as strings."
            )
        rendered = tokenizer.apply_chat_template(
            prompt, add_generation_prompt=True, tokenize=True, return_dict=True, **(chat_template_kwargs or {})
        )
        ids = list(rendered["input_ids"])
    else:
        raise ExampleError(
            f"'prompt' must be a string or a list of chat messages ({{'role': ..., 'content': ...}}), got a "
            f"{type(prompt).__name__}."
        )
    if not ids:
        raise ExampleError("the prompt renders to no tokens; generation needs at least one.")
    num_tokens = len(ids)
    if max_prompt_length is not None and num_tokens > max_prompt_length:
        ids = ids[:max_prompt_length] if prompt_truncation == "keep_start" else ids[num_tokens - max_prompt_length :]
    return {"prompt_ids": ids, "num_tokens": num_tokens}
