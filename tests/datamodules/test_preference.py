"""Preference data: TRL's formats (explicit / implicit prompt, standard / conversational), truncation of
the prompt and the completions, padding-free pairs kept apart, and clear errors."""

from __future__ import annotations

import datasets
import pytest
import torch

from lit_memtrain.datamodules.preference import PreferenceDataModule
from lit_memtrain.datamodules.preference_collate import PreferenceCollator
from lit_memtrain.datamodules.preference_tokenize import extract_prompt, tokenize_preference

USER = [{"role": "user", "content": "What is 2 + 3?"}]
GOOD = [{"role": "assistant", "content": "5"}]
BAD = [{"role": "assistant", "content": "6"}]


def _ids(tokenizer, text):
    return list(tokenizer(text)["input_ids"])


@pytest.mark.parametrize("style", ["llama", "qwen"])
def test_standard_pair_is_prompt_then_completion_with_eos(chat_tokenizers, style):
    tokenizer = chat_tokenizers[style]
    out = tokenize_preference({"prompt": "What is 2 + 3?", "chosen": " It is 5.", "rejected": " It is 6."}, tokenizer)
    assert out["prompt_ids"] == _ids(tokenizer, "What is 2 + 3?")
    whole = _ids(tokenizer, "What is 2 + 3? It is 5." + tokenizer.eos_token)
    assert out["prompt_ids"] + out["chosen_ids"] == whole and out["chosen_ids"][-1] == tokenizer.eos_token_id
    assert out["num_tokens"] == 2 * len(out["prompt_ids"]) + len(out["chosen_ids"]) + len(out["rejected_ids"])


@pytest.mark.parametrize("style", ["llama", "qwen"])
def test_conversational_pair_renders_the_chat_template(chat_tokenizers, style):
    tokenizer = chat_tokenizers[style]
    out = tokenize_preference({"prompt": USER, "chosen": GOOD, "rejected": BAD}, tokenizer)
    rendered = tokenizer.apply_chat_template(USER + GOOD, tokenize=True, return_dict=True)["input_ids"]
    assert out["prompt_ids"] + out["chosen_ids"] == list(rendered)
    generation = tokenizer.apply_chat_template(USER, tokenize=True, add_generation_prompt=True, return_dict=True)
    assert out["prompt_ids"] == list(generation["input_ids"])
    assert tokenizer.decode(out["rejected_ids"]).startswith("6")


def test_implicit_prompt_is_the_shared_prefix(tokenizer):
    explicit = tokenize_preference({"prompt": USER, "chosen": GOOD, "rejected": BAD}, tokenizer)
    assert tokenize_preference({"chosen": USER + GOOD, "rejected": USER + BAD}, tokenizer) == explicit
    assert extract_prompt("Q: 2 + 3? A: 5", "Q: 2 + 3? A: 6") == ("Q: 2 + 3? A:", " 5", " 6")
    text = tokenize_preference({"chosen": "Q: 2 + 3? A: 5", "rejected": "Q: 2 + 3? A: 6"}, tokenizer)
    assert text == tokenize_preference({"prompt": "Q: 2 + 3? A:", "chosen": " 5", "rejected": " 6"}, tokenizer)


def test_prompt_truncation_keeps_its_start_or_end_and_completions_fit_max_length(tokenizer):
    example = {"prompt": "Sort the letters of abcdefgh and then reverse them.", "chosen": " hgfedcba", "rejected": " x"}
    whole = tokenize_preference(example, tokenizer)
    assert len(whole["prompt_ids"]) > 6
    end = tokenize_preference(example, tokenizer, max_prompt_length=6, truncation_mode="keep_end")
    start = tokenize_preference(example, tokenizer, max_prompt_length=6, truncation_mode="keep_start")
    assert end["prompt_ids"] == whole["prompt_ids"][-6:] and start["prompt_ids"] == whole["prompt_ids"][:6]
    assert end["chosen_ids"] == whole["chosen_ids"] and end["num_tokens"] == whole["num_tokens"]
    cut = tokenize_preference(example, tokenizer, max_length=8, max_prompt_length=6)
    assert cut["chosen_ids"] == whole["chosen_ids"][:2] and cut["rejected_ids"] == whole["rejected_ids"][:2]


def test_clear_errors_for_bad_pairs(tokenizer):
    example = {"prompt": "Sort the letters of abcdefgh and then reverse them.", "chosen": " a", "rejected": " b"}
    with pytest.raises(ValueError, match="leaves no room for a completion within max_length=4. Set max_prompt_length"):
        tokenize_preference(example, tokenizer, max_length=4)
    with pytest.raises(ValueError, match="no 'rejected' value"):
        tokenize_preference({"prompt": "a", "chosen": "b"}, tokenizer)
    with pytest.raises(ValueError, match="both be strings or both be lists"):
        tokenize_preference({"chosen": "b", "rejected": BAD}, tokenizer)
    with pytest.raises(ValueError, match="no completion after their shared prefix"):
        tokenize_preference({"chosen": USER + GOOD, "rejected": USER + GOOD}, tokenizer)


def test_padding_free_batch_keeps_every_sequence_apart():
    pairs = [{"prompt_ids": [1, 2], "chosen_ids": [3], "rejected_ids": [4, 5]},
             {"prompt_ids": [6], "chosen_ids": [7, 8], "rejected_ids": [9]}]
    batch = PreferenceCollator(pad_token_id=0, pad_to_multiple_of=8)(pairs)
    assert batch["input_ids"].tolist() == [[1, 2, 3, 6, 7, 8, 1, 2, 4, 5, 6, 9, 0, 0, 0, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 0, 1, 2, 3, 0, 1, 0, 1, 2, 3]]
    assert batch["sequence_ids"].tolist() == [[0, 0, 0, 1, 1, 1, 2, 2, 2, 2, 3, 3, 4, 4, 4, 4]]
    assert batch["labels"].tolist() == [[-100, -100, 3, -100, 7, 8, -100, -100, 4, 5, -100, 9] + [-100] * 4]
    assert batch["cu_seq_lens_q"].tolist() == [0, 3, 6, 10, 12, 16]
    assert batch["num_pairs"] == 2 and batch["num_tokens"] == 12
    padded = PreferenceCollator(pad_token_id=0, padding_free=False)(pairs)
    assert padded["input_ids"].tolist() == [[1, 2, 3, 0], [6, 7, 8, 0], [1, 2, 4, 5], [6, 9, 0, 0]]
    assert padded["sequence_ids"].tolist() == [[0, 0, 0, 4], [1, 1, 1, 4], [2, 2, 2, 2], [3, 3, 4, 4]]
    with_reference = [{**pair, "ref_chosen_logps": -1.5, "ref_rejected_logps": -2.0} for pair in pairs]
    assert torch.equal(PreferenceCollator(0)(with_reference)["ref_rejected_logps"], torch.tensor([-2.0, -2.0]))


def test_datamodule_batches_pairs_and_counts_truncated_tokens():
    data = datasets.Dataset.from_list([{"prompt": USER, "chosen": GOOD, "rejected": BAD}] * 6)
    dm = PreferenceDataModule(dataset=data, max_length=16, max_prompt_length=12, batch_size=2, val_size=2)
    dm.setup("fit")
    assert len(dm.datasets["train"]) == 4 and len(dm.datasets["validation"]) == 2
    counts = dm.token_counts["train"]
    assert counts.truncated_tokens > 0 and counts.kept_tokens + counts.truncated_tokens == counts.tokens
    batch = next(iter(dm.train_dataloader()))
    lengths = batch["cu_seq_lens_q"].diff()
    assert batch["input_ids"].shape[0] == 1 and batch["num_pairs"] == 2 and len(lengths) == 4
    assert len(dm.datasets["train"][0]["prompt_ids"]) == 12 and (lengths <= 16).all()
    assert lengths.sum() == batch["input_ids"].shape[1]


def test_datamodule_names_the_missing_column_and_the_row_that_does_not_fit(tmp_path):
    missing = datasets.Dataset.from_list([{"prompt": "a", "chosen": "b"}])
    with pytest.raises(ValueError, match=r"\['rejected'\] is missing: the dataset has columns \['prompt', 'chosen'\]"):
        PreferenceDataModule(dataset=missing).setup("fit")
    path = tmp_path / "pairs.jsonl"
    path.write_text('{"prompt": "a", "chosen": " b", "rejected": " c"}\n' + '{"prompt": "%s", "chosen": " b", "rejected": " c"}\n' % ("word " * 40))
    with pytest.raises(ValueError, match=r"pairs.jsonl line 2: the prompt has \d+ tokens, which leaves no room"):
        PreferenceDataModule(dataset=str(path), max_length=16).setup("fit")
    with pytest.raises(ValueError, match="max_prompt_length must be at least 1 and below max_length=16"):
        PreferenceDataModule(max_length=16, max_prompt_length=16)


def test_a_row_of_an_explicit_prompt_dataset_without_its_prompt_is_an_error_not_an_extracted_prompt(tokenizer):
    """With a prompt column, a row whose prompt is missing (None) used to fall back to implicit extraction: the
    shared prefix of its completions ("The answer is 4") became the prompt, trained silently on "2" against "1"."""
    with pytest.raises(ValueError, match="the row has no 'prompt' value"):
        tokenize_preference({"prompt": None, "chosen": "The answer is 42", "rejected": "The answer is 41"}, tokenizer)
