"""Turning raw examples into ``input_ids`` and ``labels`` (unshifted; -100 where no loss is taken).

Why a separate module: these are pure functions of an example and a tokenizer, so every masking rule is
checked token by token in tests without a datamodule or a model.

Formats, detected from the columns:
- ``text``: language modelling; every token is trained; eos appended.
- ``prompt`` + ``completion``: strings, or lists of chat messages (rendered with the chat template);
  with ``completion_only_loss`` only the completion (and its eos) is trained; chat messages with
  ``assistant_only_loss`` train only on assistant turns too (as in TRL: a user turn inside the completion
  stays untrained).
- chat messages are rendered with the row's ``tools`` and ``chat_template_kwargs`` (TRL's columns) when it has them.
- ``messages``: a conversation rendered with the chat template; with ``assistant_only_loss`` only the
  assistant turns are trained. Templates with ``{% generation %}`` marks (any whitespace-trim variant, such
  as ``{%- generation %}``) give the mask directly; other templates are masked by rendering each
  conversation prefix and locating the assistant text (every token holding a character of it, as the marks do).

Special tokens follow TRL's SFT tokenization token for token: strings are tokenized with the tokenizer's
own special tokens (so Llama 3 and Gemma get their ``<bos>`` first), eos is appended as text before
tokenizing, and a prompt-completion pair is tokenized whole, the completion starting where the tokens of
the prompt alone stop matching. Chat templates write their own special tokens, so rendered conversations
are tokenized without adding any (no double BOS). One deliberate difference: a string that already starts
with the BOS token's text (a conversation rendered by hand) does not get a second BOS.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from lit_memtrain.datamodules.batch import IGNORE_INDEX

DatasetFormat = Literal["auto", "text", "prompt_completion", "conversational"]
FORMATS: dict[str, tuple[str, ...]] = {
    "text": ("text",),
    "prompt_completion": ("prompt", "completion"),
    "conversational": ("messages",),
}
_GENERATION_MARK = re.compile(r"\{%-?\s*generation\s*-?%\}")


@dataclass
class TokenCounts:
    """What was read and what was kept, in examples and tokens (a split, or one pass over a stream).

    ``tokens = kept_tokens + truncated_tokens + dropped_tokens``: truncated tokens are those past
    ``max_length`` (cut by ``bfd``, or by truncation without packing); dropped ones belong to examples
    dropped whole (no trainable token, or empty).
    """

    examples: int = 0
    tokens: int = 0
    kept_tokens: int = 0
    truncated_tokens: int = 0
    dropped_examples: int = 0
    dropped_tokens: int = 0

    def add(self, other: TokenCounts) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def describe(self, max_length: int) -> str:
        """One line for the log: examples and tokens read, kept, truncated and dropped."""
        share = f" ({100 * self.truncated_tokens / self.tokens:.1f}%)" if self.tokens else ""
        dropped = ""
        if self.dropped_examples:  # "0 in 0 dropped examples" was noise for data that drops none
            dropped = f", {self.dropped_tokens:,} in {self.dropped_examples:,} dropped examples"
        return (
            f"{self.examples:,} examples, {self.tokens:,} tokens: {self.kept_tokens:,} kept, "
            f"{self.truncated_tokens:,}{share} truncated past max_length={max_length}{dropped}"
        )


def truncation_warning(truncated: int, tokens: int, name: str, limit: str, keep: str) -> str | None:
    """A warning when truncation at ``limit`` (``"max_length=64"``) cut more than a tenth of ``name``'s ``tokens``,
    naming the options that ``keep`` them; None below a tenth. Why a warning: an info line among the start-up lines
    hid a run that trained on 1.5% of its data."""
    if not tokens or truncated * 10 <= tokens:
        return None
    return (
        f"{name}: {100 * truncated / tokens:.1f}% of the tokens ({truncated:,} of {tokens:,}) are cut past {limit}. "
        f"Keep them with {keep}."
    )


class ExampleError(ValueError):
    """One example cannot be tokenized; the datamodule adds where the example is (file and line)."""


def chat_template_errors() -> tuple[type[BaseException], ...]:
    """The exception classes a chat template raises on a row it cannot render (jinja2's ``TemplateError``; none
    when jinja2 is not installed): what the datamodules catch, with ``ValueError``, ``TypeError`` and ``KeyError``,
    to report a bad row with its file and line. A function, so that importing this module never imports jinja2."""
    try:
        from jinja2.exceptions import TemplateError
    except ImportError:
        return ()
    return (TemplateError,)


def tokenize_located(
    example: dict[str, Any], index: int, locator: Callable[[int], str], tokenize: Callable[..., dict[str, Any]],
    data_code: str = "", **kwargs: Any,
) -> dict[str, Any]:
    """``tokenize(example, **kwargs)``, with where the row is (``locator(index)``: its file and line) in any error:
    the ``datasets.map`` function of every datamodule's tokenization (``with_indices=True``). ``data_code`` is not
    used: given :func:`~lit_memtrain.datamodules.code_fingerprint.data_code_fingerprint`, it keys the ``map``
    cache to the data code."""
    try:
        return tokenize(example, **kwargs)
    except (ValueError, TypeError, KeyError, *chat_template_errors()) as error:
        raise ValueError(f"{locator(index)}: {error}") from error


def has_generation_marks(chat_template: str | None) -> bool:
    """Whether a chat template marks assistant content with ``{% generation %}`` (or ``{%- generation -%}``...)."""
    return bool(chat_template) and _GENERATION_MARK.search(chat_template) is not None


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


def required_field(example: dict[str, Any], name: str) -> Any:
    """The value of ``name`` in a row; an :class:`ExampleError` naming the columns that have a value when it has
    none (a missing column, or a null in it). Shared by the SFT and preference tokenizers, so both say the same."""
    value = example.get(name)
    if value is None:
        present = sorted(key for key, item in example.items() if item is not None)
        raise ExampleError(f"the row has no {name!r} value (it has {present}); every row needs one.")
    return value


def _check_text(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise ExampleError(
            f"{name!r}: expected text, got a {type(value).__name__} value {value!r}. Text columns must hold strings "
            "(a CSV column of numbers is read as numbers: quote it or convert the column to strings)."
        )
    return value


def _check_messages(messages: Any, name: str) -> list[dict[str, Any]]:
    if not isinstance(messages, list):
        raise ExampleError(f"{name!r}: expected a list of chat messages, got a {type(messages).__name__}.")
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ExampleError(f"{name!r}: message {index} is a {type(message).__name__}, not a dict.")
        for key in ("role", "content"):
            if message.get(key) is None:
                raise ExampleError(
                    f"{name!r}: message {index} has no {key!r} (it has {sorted(k for k, v in message.items() if v is not None)}); "
                    "every message needs a 'role' and a 'content'."
                )
        content = message["content"]
        parts = content if isinstance(content, list) else []  # a list of typed parts: {"type": "text", "text": ...}
        if not isinstance(content, (str, list)) or any(not _is_part(part) for part in parts):
            raise ExampleError(
                f"{name!r}: the 'content' of message {index} ({message['role']!r}) is not text "
                f"({type(content).__name__}: {content!r:.40}); write it as a string."
            )
    return messages


def _is_part(part: Any) -> bool:
    """Whether ``part`` of a list content is a typed part, its text (if a text part) a string."""
    return isinstance(part, dict) and "type" in part and (part["type"] != "text" or isinstance(part.get("text"), str))


def encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` with the tokenizer's special tokens, never starting with two BOS tokens."""
    ids = list(tokenizer(text)["input_ids"])
    bos, bos_text = tokenizer.bos_token_id, tokenizer.bos_token
    if bos is not None and ids[:2] == [bos, bos] and bos_text and text.startswith(bos_text):
        ids = ids[1:]
    return ids


def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    """Token ids of a string prompt as a training row of prompt + completion starts: :func:`encode`'s, without the
    special tokens a tokenizer adds after the text (BERT's ``[SEP]``), which in the row come after the completion.

    Why: generation from a model trained on string prompts (``lit-memtrain evaluate``, ``ExactAnswerAccuracy``,
    ``generate`` without a chat template) must prompt it with the tokens it was trained on; tokenizing without
    special tokens dropped the BOS token a Llama-style tokenizer puts first, and the model saw a prompt it never
    trained on.
    """
    ids = encode(tokenizer, text)
    plain = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    for start in range(len(ids) - len(plain) + 1):
        if ids[start : start + len(plain)] == plain:
            return ids[: start + len(plain)]
    return ids


def _with_eos_text(tokenizer: Any, text: str) -> str:
    eos = tokenizer.eos_token
    return text if eos is None or text.endswith(eos) else text + eos


def _common_prefix_length(ids: list[int], other: list[int]) -> int:
    length = 0
    for token, other_token in zip(ids, other):
        if token != other_token:
            break
        length += 1
    return length


def tokenize_text(example: dict[str, Any], tokenizer: Any) -> dict[str, list[int]]:
    """Language modelling: train on every token; special tokens added, eos appended."""
    text = _check_text(required_field(example, "text"), "text")
    ids = encode(tokenizer, _with_eos_text(tokenizer, text))
    return {"input_ids": ids, "labels": list(ids)}


def _chat_ids(tokenizer: Any, messages: list[dict[str, Any]], **kwargs: Any) -> dict[str, Any]:
    return tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs)


def chat_template_kwargs(example: dict[str, Any]) -> dict[str, Any]:
    """What a row gives its chat template besides the messages, as TRL reads it: its ``tools`` (tool schemas, or
    those as JSON text) and its ``chat_template_kwargs`` (a dict, e.g. ``{"enable_thinking": False}``). Why: a
    tool-calling conversation rendered without its tools trains the model on a prompt it never sees."""
    kwargs: dict[str, Any] = {}
    tools = example.get("tools")
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as error:
            raise ExampleError(
                f"'tools': not valid JSON ({error}); give a list of tool schemas or its JSON text."
            ) from None
    if tools is not None:
        kwargs["tools"] = tools
    extra = example.get("chat_template_kwargs")
    if extra is not None:
        if not isinstance(extra, dict):
            raise ExampleError(
                f"'chat_template_kwargs': expected a dict of template arguments, got a {type(extra).__name__}."
            )
        kwargs.update(extra)
    return kwargs


def tokenize_prompt_completion(
    example: dict[str, Any], tokenizer: Any, completion_only_loss: bool = True, assistant_only_loss: bool = False
) -> dict[str, list[int]]:
    """Prompt followed by completion, tokenized whole; with ``completion_only_loss`` the prompt is masked.

    With ``assistant_only_loss``, chat messages train only on assistant turns as well (TRL applies a conversation's
    assistant mask to prompt-completion data too): a user or tool turn inside the completion stays untrained, and
    without ``completion_only_loss`` the prompt's assistant turns train. String columns have no turns to mask.
    """
    prompt, completion = required_field(example, "prompt"), required_field(example, "completion")
    assistant_mask = None
    if isinstance(prompt, list) or isinstance(completion, list):
        prompt = _check_messages(prompt, "prompt")
        completion = _check_messages(completion, "completion")
        template = chat_template_kwargs(example)
        prompt_ids = list(_chat_ids(tokenizer, prompt, add_generation_prompt=True, **template)["input_ids"])
        # Without marks, a completion of assistant turns that alone trains is its own assistant mask: the prefix
        # method is left out there, as it refuses templates that render earlier turns differently (reasoning cut).
        masks_more = not completion_only_loss or any(message["role"] != "assistant" for message in completion)
        if assistant_only_loss and (masks_more or has_generation_marks(tokenizer.chat_template)):
            input_ids, assistant_mask = _assistant_tokens(tokenizer, prompt + completion, template)
        else:
            input_ids = list(_chat_ids(tokenizer, prompt + completion, **template)["input_ids"])
        prompt_length = _common_prefix_length(prompt_ids, input_ids)
        if prompt_length < len(prompt_ids):
            raise ExampleError(
                "the chat template renders the prompt differently once the completion is appended (or its last "
                "tokens merge with the completion's), so the completion cannot be located. Use a template with "
                "{% generation %} marks and 'messages' data, or string columns."
            )
    else:
        prompt = _check_text(prompt, "prompt")
        completion = _check_text(completion, "completion")
        prompt_ids = encode(tokenizer, prompt)
        input_ids = encode(tokenizer, prompt + _with_eos_text(tokenizer, completion))
        prompt_length = _common_prefix_length(prompt_ids, input_ids)
    trained = [not completion_only_loss or index >= prompt_length for index in range(len(input_ids))]
    if assistant_mask is not None:
        trained = [keep and assistant for keep, assistant in zip(trained, assistant_mask)]
    labels = [token if keep else IGNORE_INDEX for token, keep in zip(input_ids, trained)]
    return {"input_ids": input_ids, "labels": labels}


def _render(
    tokenizer: Any, messages: list[dict[str, Any]], template: dict[str, Any], add_generation_prompt: bool = False
) -> str:
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, **template
    )


def _assistant_char_spans(
    tokenizer: Any, messages: list[dict[str, Any]], full_text: str, template: dict[str, Any]
) -> list[tuple[int, int]]:
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i], template, add_generation_prompt=True)
        through = _render(tokenizer, messages[: i + 1], template)
        if not (through.startswith(before) and full_text.startswith(through)):
            raise ValueError(
                "The tokenizer's chat template is not prefix-stable (rendering a conversation prefix does not "
                "give a prefix of the whole conversation), so assistant turns cannot be located. Add "
                "{% generation %} ... {% endgeneration %} marks around assistant content in the template, "
                "or set assistant_only_loss=False."
            )
        spans.append((len(before), len(through)))
    return spans


def _assistant_tokens(
    tokenizer: Any, messages: list[dict[str, Any]], template: dict[str, Any]
) -> tuple[list[int], list[bool]]:
    """The conversation's token ids and which of them belong to assistant turns.

    Templates with ``{% generation %}`` marks give the mask directly (transformers marks every token that holds a
    character of the marked text). Others are masked by locating each assistant turn's characters from rendered
    prefixes and marking the same tokens: those that hold a character of a turn, including one that begins just
    before it (a generation prompt ending in a space merges with the answer's first word into one token).
    """
    if has_generation_marks(tokenizer.chat_template):
        out = _chat_ids(tokenizer, messages, return_assistant_tokens_mask=True, **template)
        return list(out["input_ids"]), [bool(bit) for bit in out["assistant_masks"]]
    full_text = _render(tokenizer, messages, template)
    spans = _assistant_char_spans(tokenizer, messages, full_text, template)
    encoded = tokenizer(full_text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [
        any(lo <= start < hi or start < lo < end for lo, hi in spans) for start, end in encoded["offset_mapping"]
    ]
    return list(encoded["input_ids"]), mask


def tokenize_conversation(
    example: dict[str, Any], tokenizer: Any, assistant_only_loss: bool = True
) -> dict[str, list[int]]:
    """A chat rendered with the tokenizer's template; with ``assistant_only_loss`` only assistant turns train."""
    messages = _check_messages(required_field(example, "messages"), "messages")
    template = chat_template_kwargs(example)
    if not assistant_only_loss:
        ids = list(_chat_ids(tokenizer, messages, **template)["input_ids"])
        return {"input_ids": ids, "labels": list(ids)}
    ids, mask = _assistant_tokens(tokenizer, messages, template)
    labels = [token if keep else IGNORE_INDEX for token, keep in zip(ids, mask)]
    return {"input_ids": ids, "labels": labels}


def count_trainable(labels: list[int]) -> int:
    """Labels predicted from an earlier token (positions 1 onwards): what the shifted loss trains on."""
    return sum(1 for label in labels[1:] if label != IGNORE_INDEX)


def tokenize_example(
    example: dict[str, Any],
    tokenizer: Any,
    dataset_format: str,
    max_length: int | None = None,
    completion_only_loss: bool = True,
    assistant_only_loss: bool = True,
) -> dict[str, Any]:
    """Tokenize one example of ``dataset_format``; keep its first ``max_length`` tokens (all when None).

    Returns ``input_ids``, ``labels``, ``num_tokens`` (the length before truncation, so the truncated tokens
    can be counted) and ``num_trainable`` (see :func:`count_trainable`, on the kept labels); an example with
    no trainable token is dropped by the datamodule.
    """
    if dataset_format == "text":
        out = tokenize_text(example, tokenizer)
    elif dataset_format == "prompt_completion":
        out = tokenize_prompt_completion(example, tokenizer, completion_only_loss, assistant_only_loss)
    else:
        out = tokenize_conversation(example, tokenizer, assistant_only_loss)
    num_tokens = len(out["input_ids"])
    input_ids, labels = out["input_ids"][:max_length], out["labels"][:max_length]
    return {"input_ids": input_ids, "labels": labels, "num_tokens": num_tokens, "num_trainable": count_trainable(labels)}
