import copy
import json
import warnings

import pytest

from lit_memtrain.datamodules.tokenize import detect_format, tokenize_example
from lit_memtrain.datamodules.batch import IGNORE_INDEX

CONVERSATION = [
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "5"},
    {"role": "user", "content": "Reverse the word abc."},
    {"role": "assistant", "content": "cba"},
]


def _ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _trained_text(tokenizer, out):
    return [tokenizer.decode([t]) for t, label in zip(out["input_ids"], out["labels"]) if label != IGNORE_INDEX]


def test_text_trains_every_token_and_appends_eos(tokenizer):
    out = tokenize_example({"text": "Sort the letters of cab."}, tokenizer, "text", max_length=100)
    expected = _ids(tokenizer, "Sort the letters of cab.") + [tokenizer.eos_token_id]
    assert out["input_ids"] == expected
    assert out["labels"] == expected
    assert out["num_trainable"] == len(expected) - 1


@pytest.mark.parametrize("completion_only", [True, False])
def test_prompt_completion_masks_the_prompt(tokenizer, completion_only):
    example = {"prompt": "What is 2 + 3?", "completion": " 5"}
    out = tokenize_example(example, tokenizer, "prompt_completion", 100, completion_only_loss=completion_only)
    prompt, completion = _ids(tokenizer, "What is 2 + 3?"), _ids(tokenizer, " 5") + [tokenizer.eos_token_id]
    assert out["input_ids"] == prompt + completion
    if completion_only:
        assert out["labels"] == [IGNORE_INDEX] * len(prompt) + completion
    else:
        assert out["labels"] == prompt + completion


def test_conversational_prompt_completion(tokenizer):
    example = {"prompt": CONVERSATION[:1], "completion": CONVERSATION[1:2]}
    out = tokenize_example(example, tokenizer, "prompt_completion", 100, assistant_only_loss=False)
    assert "".join(_trained_text(tokenizer, out)) == "5<|im_end|>\n"
    # assistant_only_loss (the default) also applies the template's assistant marks, as TRL does: not the newline.
    out = tokenize_example(example, tokenizer, "prompt_completion", 100)
    assert "".join(_trained_text(tokenizer, out)) == "5<|im_end|>"


def test_assistant_only_loss_leaves_a_user_turn_of_the_completion_untrained(tokenizer):
    example = {"prompt": CONVERSATION[:1], "completion": CONVERSATION[1:]}  # assistant, user, assistant
    out = tokenize_example(example, tokenizer, "prompt_completion", 100)
    assert "".join(_trained_text(tokenizer, out)) == "5<|im_end|>cba<|im_end|>"
    everything = tokenize_example(example, tokenizer, "prompt_completion", 100, completion_only_loss=False)
    assert "".join(_trained_text(tokenizer, everything)) == "5<|im_end|>cba<|im_end|>"
    plain = copy.deepcopy(tokenizer)  # no {% generation %} marks: the prefix method locates the turns
    plain.chat_template = tokenizer.chat_template.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    out = tokenize_example(example, plain, "prompt_completion", 100)
    assert "".join(_trained_text(plain, out)) == "5<|im_end|>\ncba<|im_end|>\n"


def test_assistant_only_loss_with_generation_marks(tokenizer):
    out = tokenize_example({"messages": CONVERSATION}, tokenizer, "conversational", 100)
    assert "".join(_trained_text(tokenizer, out)) == "5<|im_end|>cba<|im_end|>"
    full = tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    assert out["input_ids"] == _ids(tokenizer, full)


def test_assistant_only_loss_without_generation_marks(tokenizer):
    plain = copy.deepcopy(tokenizer)
    plain.chat_template = tokenizer.chat_template.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    out = tokenize_example({"messages": CONVERSATION}, plain, "conversational", 100)
    # The prefix method also covers the newline the template writes after each turn.
    assert "".join(_trained_text(plain, out)) == "5<|im_end|>\ncba<|im_end|>\n"


# A template whose generation prompt ends with a space: the space and the first word of the answer merge into one
# token (" 5"), which starts one character before the assistant text.
SPACED_TEMPLATE = (
    "{%- for message in messages %}{{- message['role'] + ': ' }}"
    "{%- if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{%- else %}{{- message['content'] + '<|im_end|>' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- 'assistant: ' }}{%- endif %}"
)


@pytest.mark.parametrize("style", ["llama", "qwen"])
def test_a_token_that_straddles_the_start_of_an_assistant_turn_is_trained_without_marks(chat_tokenizers, style):
    marked = copy.deepcopy(chat_tokenizers[style])
    marked.chat_template = SPACED_TEMPLATE
    plain = copy.deepcopy(marked)
    plain.chat_template = SPACED_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    with_marks = tokenize_example({"messages": CONVERSATION}, marked, "conversational")
    without = tokenize_example({"messages": CONVERSATION}, plain, "conversational")
    assert with_marks["input_ids"] == without["input_ids"]
    assert _trained_text(marked, with_marks)[0] == " 5"  # the merge happens: " 5" is one token
    # The prefix method marks the same tokens as transformers' marks: every token holding a character of the turn.
    assert without["labels"] == with_marks["labels"]


def test_a_template_that_renders_earlier_turns_differently_still_masks_a_plain_completion(tokenizer):
    odd = copy.deepcopy(tokenizer)  # no marks, and the last assistant turn gets a tag the earlier ones lose
    template = tokenizer.chat_template.replace("{% endgeneration %}", "")
    odd.chat_template = template.replace("{% generation %}", "{% if loop.last %}<last>{% endif %}")
    example = {"prompt": CONVERSATION[:3], "completion": CONVERSATION[3:]}
    out = tokenize_example(example, odd, "prompt_completion", 100)
    assert "".join(_trained_text(odd, out)) == "<last>cba<|im_end|>\n"
    with pytest.raises(ValueError, match="not prefix-stable"):  # what the prefix method would say
        tokenize_example(example, odd, "prompt_completion", 100, completion_only_loss=False)


def test_conversation_without_assistant_mask_trains_everything(tokenizer):
    out = tokenize_example({"messages": CONVERSATION}, tokenizer, "conversational", 100, assistant_only_loss=False)
    assert out["labels"] == out["input_ids"]


def test_non_prefix_stable_template_is_refused(tokenizer):
    odd = copy.deepcopy(tokenizer)
    odd.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}{{ messages | length }}"
    with pytest.raises(ValueError, match="not prefix-stable"):
        tokenize_example({"messages": CONVERSATION}, odd, "conversational", 100)


def test_truncation_keeps_the_first_tokens(tokenizer):
    full = tokenize_example({"messages": CONVERSATION}, tokenizer, "conversational", 1000)
    cut = tokenize_example({"messages": CONVERSATION}, tokenizer, "conversational", 10)
    assert cut["input_ids"] == full["input_ids"][:10]
    assert cut["labels"] == full["labels"][:10]
    assert cut["num_trainable"] == 0  # the first assistant token sits past position 10


def test_detect_format():
    assert detect_format(["messages", "id"]) == "conversational"
    assert detect_format(["prompt", "completion"]) == "prompt_completion"
    assert detect_format(["text"]) == "text"
    with pytest.raises(ValueError, match=r"columns \['question', 'answer'\].*prompt_completion: column\(s\) prompt"):
        detect_format(["question", "answer"])
    with pytest.raises(ValueError, match="needs column"):
        detect_format(["text"], "conversational")


# --- special tokens and TRL parity (issue 13, point 2) ---------------------------------------------------------

PARITY_EXAMPLES = {
    "text": [
        {"text": "The quick brown fox jumps over the lazy dog."},
        {"text": "  Hello there, assistant!"},
        {"text": "What is 2 + 3?<|eot_id|>"},  # already ends with Llama's eos
        {"text": "Reverse the word abc: cba.<|im_end|>"},  # already ends with Qwen's eos
    ],
    "prompt_completion": [
        {"prompt": "What is 2 + 3?", "completion": " It is 5."},
        {"prompt": "Hel", "completion": "lo there"},  # tokens merge across the boundary
        {"prompt": "Sort the letters of cab.", "completion": " They are abc.<|eot_id|>"},
    ],
    "conversational_prompt_completion": [
        {"prompt": CONVERSATION[:1], "completion": CONVERSATION[1:2]},
        {"prompt": CONVERSATION[:3], "completion": CONVERSATION[3:]},
    ],
    "conversational": [{"messages": CONVERSATION}, {"messages": CONVERSATION[:2]}],
}


def _trl_tokenized(tokenizer, rows, completion_only_loss, assistant_only_loss, tmp_path):
    """TRL's own SFT preparation of ``rows`` (SFTTrainer._prepare_dataset, no packing or truncation)."""
    trl = pytest.importorskip("trl")
    from types import SimpleNamespace

    from datasets import Dataset
    from trl.trainer.sft_trainer import SFTTrainer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        args = trl.SFTConfig(
            output_dir=str(tmp_path), max_length=None, report_to=[], bf16=False, use_cpu=True,
            assistant_only_loss=assistant_only_loss,
        )
    trainer = SimpleNamespace(_tokenizer=tokenizer, completion_only_loss=completion_only_loss, chat_template=None)
    return SFTTrainer._prepare_dataset(trainer, Dataset.from_list(rows), tokenizer, args, False, None, "train")


@pytest.mark.parametrize("style", ["llama", "qwen"])
@pytest.mark.parametrize("completion_only", [True, False])
@pytest.mark.parametrize("assistant_only", [True, False])
def test_conversational_prompt_completion_masks_as_trl(
    chat_tokenizers, tmp_path, style, completion_only, assistant_only
):
    tokenizer = chat_tokenizers[style]
    rows = [
        {"prompt": CONVERSATION[:1], "completion": CONVERSATION[1:]},  # a user turn inside the completion
        {"prompt": CONVERSATION[:3], "completion": CONVERSATION[3:]},  # an assistant turn inside the prompt
    ]
    expected = _trl_tokenized(tokenizer, rows, completion_only, assistant_only, tmp_path)
    for row, theirs in zip(rows, expected):
        masks = {"completion_only_loss": completion_only, "assistant_only_loss": assistant_only}
        ours = tokenize_example(row, tokenizer, "prompt_completion", **masks)
        assert ours["input_ids"] == theirs["input_ids"]
        assert ours["labels"] == theirs["labels"]


@pytest.mark.parametrize("style", ["llama", "qwen"])
@pytest.mark.parametrize("kind", list(PARITY_EXAMPLES))
@pytest.mark.parametrize("masked", [True, False])
def test_same_tokens_and_labels_as_trl(chat_tokenizers, tmp_path, style, kind, masked):
    tokenizer = chat_tokenizers[style]
    rows = PARITY_EXAMPLES[kind]
    dataset_format = "conversational" if kind == "conversational" else ("text" if kind == "text" else "prompt_completion")
    assistant_only = masked and kind == "conversational"
    expected = _trl_tokenized(tokenizer, rows, completion_only_loss=masked, assistant_only_loss=assistant_only, tmp_path=tmp_path)
    for row, theirs in zip(rows, expected):
        ours = tokenize_example(
            row, tokenizer, dataset_format, completion_only_loss=masked, assistant_only_loss=assistant_only
        )
        assert ours["input_ids"] == theirs["input_ids"]
        assert ours["labels"] == theirs["labels"]


TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two numbers.", "parameters": {}}}]


@pytest.mark.parametrize("kind", ["conversational", "conversational_prompt_completion"])
@pytest.mark.parametrize("masked", [True, False])
def test_a_row_s_tools_and_chat_template_kwargs_reach_the_template_as_in_trl(chat_tokenizers, tmp_path, kind, masked):
    from tests.datamodules.conftest import QWEN_TEMPLATE

    tokenizer = copy.deepcopy(chat_tokenizers["qwen"])
    tokenizer.chat_template = (
        "{%- if tools %}{{- '<|im_start|>system\\nTools: ' + (tools | map(attribute='function') | map(attribute='name')"
        " | join(', ')) + '<|im_end|>\\n' }}{%- endif %}"
        "{%- if brief %}{{- '<|im_start|>system\\nBe brief.<|im_end|>\\n' }}{%- endif %}" + QWEN_TEMPLATE
    )
    extras = [  # TRL's columns: tools as JSON text (or a list), chat_template_kwargs a dict
        {"tools": json.dumps(TOOLS), "chat_template_kwargs": {"brief": True}},
        {"tools": json.dumps(TOOLS), "chat_template_kwargs": {"brief": False}},
    ]
    if kind == "conversational":
        rows = [{"messages": CONVERSATION, **extra} for extra in extras]
    else:
        rows = [{"prompt": CONVERSATION[:3], "completion": CONVERSATION[3:], **extra} for extra in extras]
    dataset_format = "conversational" if kind == "conversational" else "prompt_completion"
    expected = _trl_tokenized(tokenizer, rows, masked, masked, tmp_path)
    for row, theirs in zip(rows, expected):
        ours = tokenize_example(row, tokenizer, dataset_format, completion_only_loss=masked, assistant_only_loss=masked)
        assert ours["input_ids"] == theirs["input_ids"]
        assert ours["labels"] == theirs["labels"]
    rendered = tokenizer.decode(tokenize_example(rows[0], tokenizer, dataset_format)["input_ids"])
    assert rendered.startswith("<|im_start|>system\nTools: add<|im_end|>\n<|im_start|>system\nBe brief.")


def test_strings_start_with_the_bos_the_tokenizer_adds(chat_tokenizers):
    llama, qwen = chat_tokenizers["llama"], chat_tokenizers["qwen"]
    out = tokenize_example({"text": "Hello there"}, llama, "text")
    assert out["input_ids"][0] == llama.bos_token_id and out["input_ids"][-1] == llama.eos_token_id
    assert out["input_ids"].count(llama.bos_token_id) == 1
    pair = tokenize_example({"prompt": "What is 2 + 3?", "completion": " It is 5."}, llama, "prompt_completion")
    assert pair["input_ids"][0] == llama.bos_token_id and pair["labels"][0] == IGNORE_INDEX
    assert tokenize_example({"text": "Hello there"}, qwen, "text")["input_ids"] == _ids(qwen, "Hello there") + [
        qwen.eos_token_id
    ]


def test_no_double_bos_when_the_template_or_the_text_already_has_one(chat_tokenizers):
    llama = chat_tokenizers["llama"]
    bos = llama.bos_token_id
    chat = tokenize_example({"messages": CONVERSATION}, llama, "conversational")
    assert chat["input_ids"][0] == bos and chat["input_ids"].count(bos) == 1
    rendered = llama.apply_chat_template(CONVERSATION, tokenize=False)
    assert rendered.startswith("<|begin_of_text|>")
    as_text = tokenize_example({"text": rendered}, llama, "text")
    assert as_text["input_ids"][:2] != [bos, bos] and as_text["input_ids"].count(bos) == 1
    pair = tokenize_example(
        {"prompt": llama.apply_chat_template(CONVERSATION[:1], tokenize=False, add_generation_prompt=True),
         "completion": "5<|eot_id|>"},
        llama,
        "prompt_completion",
    )
    assert pair["input_ids"].count(bos) == 1 and pair["input_ids"] == chat["input_ids"][: len(pair["input_ids"])]


@pytest.mark.parametrize(
    "marks",
    [("{%- generation %}", "{%- endgeneration %}"), ("{% generation -%}", "{% endgeneration -%}"), ("{%- generation -%}", "{%- endgeneration -%}")],
)
def test_generation_mark_variants_are_recognised(tokenizer, marks):
    from lit_memtrain.datamodules.tokenize import has_generation_marks

    variant = copy.deepcopy(tokenizer)
    variant.chat_template = tokenizer.chat_template.replace("{% generation %}", marks[0]).replace(
        "{% endgeneration %}", marks[1]
    )
    assert has_generation_marks(variant.chat_template)
    out = tokenize_example({"messages": CONVERSATION}, variant, "conversational", 100)
    # The marks give the assistant content and its end token only; the prefix method would add the newline.
    assert "".join(_trained_text(variant, out)) == "5<|im_end|>cba<|im_end|>"
    assert not has_generation_marks("{% for m in messages %}{{ m['content'] }}{% endfor %}")


@pytest.mark.parametrize(
    ("example", "dataset_format", "message"),
    [
        ({"text": None}, "text", "the row has no 'text' value"),
        ({"prompt": "q", "completion": None}, "prompt_completion", "the row has no 'completion' value"),
        ({"messages": [{"role": "user", "content": "hi"}, {"content": "x"}]}, "conversational", "message 1 has no 'role'"),
        ({"messages": [{"role": "user"}]}, "conversational", "message 0 has no 'content'"),
    ],
)
def test_missing_fields_are_named(tokenizer, example, dataset_format, message):
    with pytest.raises(ValueError, match=message):
        tokenize_example(example, tokenizer, dataset_format)
