"""Turning raw examples into ``input_ids`` and ``labels`` (unshifted; -100 where no loss is taken).

Why a separate module: these are pure functions of an example and a tokenizer, so every masking rule is
checked token by token in tests without a datamodule or a model.

Formats, detected from the columns:
- ``text``: language modelling; every token is trained; eos appended.
- ``prompt`` + ``completion``: strings, or lists of chat messages (rendered with the chat template);
  with ``completion_only_loss`` only the completion (and its eos) is trained.
- ``messages``: a conversation rendered with the chat template; with ``assistant_only_loss`` only the
  assistant turns are trained. Templates with ``{% generation %}`` marks give the mask directly; other
  templates are masked by rendering each conversation prefix and locating the assistant text.
"""

from __future__ import annotations

from typing import Any, Literal

IGNORE_INDEX = -100
DatasetFormat = Literal["auto", "text", "prompt_completion", "conversational"]
FORMATS: dict[str, tuple[str, ...]] = {
    "text": ("text",),
    "prompt_completion": ("prompt", "completion"),
    "conversational": ("messages",),
}


def detect_format(columns: list[str], requested: DatasetFormat = "auto") -> str:
    """Return the dataset format for ``columns``, or raise a ValueError that lists what was found."""
    supported = "; ".join(f"{name}: column(s) {', '.join(cols)}" for name, cols in FORMATS.items())
    if requested != "auto":
        if requested not in FORMATS:
            raise ValueError(f"Unknown dataset_format {requested!r}. Supported formats: {supported}.")
        missing = [c for c in FORMATS[requested] if c not in columns]
        if missing:
            raise ValueError(
                f"dataset_format={requested!r} needs column(s) {missing}, but the dataset has columns {columns}."
            )
        return requested
    for name in ("conversational", "prompt_completion", "text"):
        if all(c in columns for c in FORMATS[name]):
            return name
    raise ValueError(
        f"Cannot tell the dataset format from its columns {columns}. Supported formats: {supported}. "
        "Rename your columns, or map the dataset to one of these shapes first."
    )


def _ids(tokenizer: Any, text: str) -> list[int]:
    if not isinstance(text, str):
        raise ValueError(
            f"Expected text, got a {type(text).__name__} value {text!r}. Text columns must hold strings "
            "(a CSV column of numbers is read as numbers: quote it or convert the column to strings)."
        )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _with_eos(tokenizer: Any, ids: list[int]) -> list[int]:
    eos = tokenizer.eos_token_id
    if eos is not None and (not ids or ids[-1] != eos):
        return ids + [eos]
    return ids


def tokenize_text(example: dict[str, Any], tokenizer: Any) -> dict[str, list[int]]:
    """Language modelling: train on every token, eos appended."""
    ids = _with_eos(tokenizer, _ids(tokenizer, example["text"]))
    return {"input_ids": ids, "labels": list(ids)}


def _render(tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def tokenize_prompt_completion(
    example: dict[str, Any], tokenizer: Any, completion_only_loss: bool = True
) -> dict[str, list[int]]:
    """Prompt followed by completion; with ``completion_only_loss`` the prompt is masked."""
    prompt, completion = example["prompt"], example["completion"]
    if isinstance(prompt, list):
        prompt_text = _render(tokenizer, prompt, add_generation_prompt=True)
        full_text = _render(tokenizer, prompt + completion)
        if not full_text.startswith(prompt_text):
            raise ValueError(
                "The chat template renders the prompt differently once the completion is appended, so the "
                "completion cannot be located. Use a template with {% generation %} marks or string columns."
            )
        prompt_ids = _ids(tokenizer, prompt_text)
        completion_ids = _ids(tokenizer, full_text[len(prompt_text) :])
    else:
        prompt_ids = _ids(tokenizer, prompt)
        completion_ids = _with_eos(tokenizer, _ids(tokenizer, completion))
    input_ids = prompt_ids + completion_ids
    if completion_only_loss:
        labels = [IGNORE_INDEX] * len(prompt_ids) + list(completion_ids)
    else:
        labels = list(input_ids)
    return {"input_ids": input_ids, "labels": labels}


def _assistant_char_spans(tokenizer: Any, messages: list[dict[str, Any]], full_text: str) -> list[tuple[int, int]]:
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i], add_generation_prompt=True)
        through = _render(tokenizer, messages[: i + 1])
        if not (through.startswith(before) and full_text.startswith(through)):
            raise ValueError(
                "The tokenizer's chat template is not prefix-stable (rendering a conversation prefix does not "
                "give a prefix of the whole conversation), so assistant turns cannot be located. Add "
                "{% generation %} ... {% endgeneration %} marks around assistant content in the template, "
                "or set assistant_only_loss=False."
            )
        spans.append((len(before), len(through)))
    return spans


def tokenize_conversation(
    example: dict[str, Any], tokenizer: Any, assistant_only_loss: bool = True
) -> dict[str, list[int]]:
    """A chat rendered with the tokenizer's template; with ``assistant_only_loss`` only assistant turns train."""
    messages = example["messages"]
    if not assistant_only_loss:
        ids = _ids(tokenizer, _render(tokenizer, messages))
        return {"input_ids": ids, "labels": list(ids)}
    if "{% generation %}" in (tokenizer.chat_template or ""):
        out = tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        ids, mask = list(out["input_ids"]), out["assistant_masks"]
    else:
        full_text = _render(tokenizer, messages)
        spans = _assistant_char_spans(tokenizer, messages, full_text)
        encoded = tokenizer(full_text, add_special_tokens=False, return_offsets_mapping=True)
        ids = encoded["input_ids"]
        mask = [any(lo <= start < hi for lo, hi in spans) for start, _ in encoded["offset_mapping"]]
    labels = [token if keep else IGNORE_INDEX for token, keep in zip(ids, mask)]
    return {"input_ids": ids, "labels": labels}


def tokenize_example(
    example: dict[str, Any],
    tokenizer: Any,
    dataset_format: str,
    max_length: int,
    completion_only_loss: bool = True,
    assistant_only_loss: bool = True,
) -> dict[str, Any]:
    """Tokenize one example of ``dataset_format``, keep its first ``max_length`` tokens and count trainable targets.

    ``num_trainable`` counts labels that are predicted from an earlier token (positions 1 onwards), which is what
    the shifted loss trains on; an example with none is dropped by the datamodule.
    """
    if dataset_format == "text":
        out = tokenize_text(example, tokenizer)
    elif dataset_format == "prompt_completion":
        out = tokenize_prompt_completion(example, tokenizer, completion_only_loss)
    else:
        out = tokenize_conversation(example, tokenizer, assistant_only_loss)
    input_ids, labels = out["input_ids"][:max_length], out["labels"][:max_length]
    num_trainable = sum(1 for label in labels[1:] if label != IGNORE_INDEX)
    return {"input_ids": input_ids, "labels": labels, "num_trainable": num_trainable}
