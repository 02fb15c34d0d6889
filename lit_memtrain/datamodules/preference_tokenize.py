"""Turning preference pairs into ``prompt_ids``, ``chosen_ids`` and ``rejected_ids``.

Why a separate module: like :mod:`lit_memtrain.datamodules.tokenize` for SFT, these are pure functions of
an example and a tokenizer, checked token by token in tests without a datamodule or a model.

Formats (TRL's preference formats):

- explicit prompt: ``prompt``, ``chosen``, ``rejected``; strings (standard) or lists of chat messages
  (conversational, rendered with the tokenizer's chat template).
- implicit prompt: ``chosen`` and ``rejected`` only, each the whole text or conversation; the prompt is their
  shared prefix (the messages both start with; for strings, the characters, a space before the first
  difference going to the completions).

Each side is tokenized as SFT tokenizes a prompt-completion pair
(:func:`~lit_memtrain.datamodules.tokenize.tokenize_prompt_completion`: tokenized whole, eos appended to
string completions, the completion starting where the prompt's own tokens stop matching), and the prompt is
the tokens both sides share, as TRL's ``DPOTrainer`` does. So one pair gives TRL's tokens.

Truncation, as TRL's ``DPOTrainer`` with ``truncation_mode="keep_start"``: each sequence (prompt + chosen,
prompt + rejected, the eos of a completion counted) keeps its first ``max_length`` tokens, so the completions
are cut at their end, each to its own length. A prompt that alone fills ``max_length`` leaves no completion
token: such a pair comes back with empty completions, and the datamodule drops it (and counts it), as TRL
drops it. Before that, ``max_prompt_length`` (not in TRL) keeps the prompt's first (``prompt_truncation=
"keep_start"``) or last (``"keep_end"``, nearest the answer) tokens, so that long prompts are cut, not dropped.
"""

from __future__ import annotations

from typing import Any, Literal

from lit_memtrain.datamodules.tokenize import ExampleError, required_field, tokenize_prompt_completion
from lit_memtrain.datamodules.batch import IGNORE_INDEX

PromptTruncation = Literal["keep_start", "keep_end"]
PREFERENCE_COLUMNS = ("chosen", "rejected")


def detect_preference_format(columns: list[str]) -> Literal["explicit", "implicit"]:
    """``explicit`` (a ``prompt`` column) or ``implicit``; a ValueError listing the columns when one is missing."""
    missing = [c for c in PREFERENCE_COLUMNS if c not in columns]
    if missing:
        raise ValueError(
            f"Preference data needs the columns 'chosen' and 'rejected' (and optionally 'prompt'), but {missing} "
            f"is missing: the dataset has columns {columns}. Rename your columns, or map the dataset to TRL's "
            "preference format (prompt / chosen / rejected) first."
        )
    return "explicit" if "prompt" in columns else "implicit"


def extract_prompt(chosen: Any, rejected: Any) -> tuple[Any, Any, Any]:
    """Split two whole texts or conversations into their shared prompt and the two completions."""
    if isinstance(chosen, str) and isinstance(rejected, str):
        end = 0
        for a, b in zip(chosen, rejected):
            if a != b:
                break
            end += 1
        if end and chosen[end - 1] == " ":  # "... A: 4" vs "... A: 5": the space starts the completions
            end -= 1
    elif isinstance(chosen, list) and isinstance(rejected, list):
        end = 0
        for a, b in zip(chosen, rejected):
            if a != b:
                break
            end += 1
    else:
        raise ExampleError(
            f"'chosen' and 'rejected' must both be strings or both be lists of chat messages, got a "
            f"{type(chosen).__name__} and a {type(rejected).__name__}."
        )
    if end == len(chosen) or end == len(rejected):
        raise ExampleError(
            "'chosen' and 'rejected' have no completion after their shared prefix (one is a prefix of the other), "
            "so no prompt can be extracted. Give a 'prompt' column, or make both end with their own answer."
        )
    return chosen[:end], chosen[end:], rejected[end:]


def _prompt_length(labels: list[int]) -> int:
    return next((i for i, label in enumerate(labels) if label != IGNORE_INDEX), len(labels))


def tokenize_preference(
    example: dict[str, Any],
    tokenizer: Any,
    max_length: int | None = None,
    max_prompt_length: int | None = None,
    prompt_truncation: PromptTruncation = "keep_end",
) -> dict[str, Any]:
    """Tokenize one preference pair and truncate it.

    Returns ``prompt_ids``, ``chosen_ids`` and ``rejected_ids`` (the completions, without the prompt) and
    ``num_tokens``, the tokens of both sequences (prompt + chosen, prompt + rejected) before truncation. When the
    prompt (after ``max_prompt_length``) alone fills ``max_length``, both completions are empty: the pair has
    nothing to train on.

    Raises:
        ExampleError: a missing value, mixed string and message values, a pair with no completion, or a
            completion that renders to no tokens.
    """
    chosen, rejected = required_field(example, "chosen"), required_field(example, "rejected")
    if "prompt" in example:  # a row of an explicit-prompt dataset: never extract a prompt from its completions
        prompt = required_field(example, "prompt")
    else:
        prompt, chosen, rejected = extract_prompt(chosen, rejected)
    template = {name: example[name] for name in ("tools", "chat_template_kwargs") if name in example}  # TRL's columns
    sides = [
        tokenize_prompt_completion({"prompt": prompt, "completion": completion, **template}, tokenizer)
        for completion in (chosen, rejected)
    ]
    shared = min(_prompt_length(side["labels"]) for side in sides)
    prompt_ids = sides[0]["input_ids"][:shared]
    chosen_ids, rejected_ids = (side["input_ids"][shared:] for side in sides)
    if not chosen_ids or not rejected_ids:
        raise ExampleError("the 'chosen' or 'rejected' completion renders to no tokens; every completion needs one.")
    num_tokens = 2 * len(prompt_ids) + len(chosen_ids) + len(rejected_ids)
    if max_prompt_length is not None and len(prompt_ids) > max_prompt_length:
        cut = len(prompt_ids) - max_prompt_length
        prompt_ids = prompt_ids[:max_prompt_length] if prompt_truncation == "keep_start" else prompt_ids[cut:]
    if max_length is not None:  # each sequence keeps its first max_length tokens
        prompt_ids = prompt_ids[:max_length]
        room = max_length - len(prompt_ids)
        chosen_ids, rejected_ids = chosen_ids[:room], rejected_ids[:room]
    return {"prompt_ids": prompt_ids, "chosen_ids": chosen_ids, "rejected_ids": rejected_ids, "num_tokens": num_tokens}
