import copy

import pytest

from lit_memtrain.datamodules.tokenize import IGNORE_INDEX, detect_format, tokenize_example

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
    out = tokenize_example(example, tokenizer, "prompt_completion", 100)
    assert "".join(_trained_text(tokenizer, out)) == "5<|im_end|>\n"


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
