"""Preference data: TRL's formats (explicit / implicit prompt, standard / conversational), truncation as TRL's
DPOTrainer truncates (and drops), the prompt cut of max_prompt_length, padding-free pairs kept apart, and clear
errors."""

from __future__ import annotations

from pathlib import Path

import datasets
import pytest
import torch

from lit_memtrain.datamodules.preference import PreferenceDataModule
from lit_memtrain.datamodules.preference_collate import PreferenceCollator
from lit_memtrain.datamodules.preference_tokenize import extract_prompt, tokenize_preference

DPO_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "dpo.yaml"

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


def test_a_pair_s_tools_and_chat_template_kwargs_reach_the_template(chat_tokenizers):
    import copy
    import json

    tokenizer = copy.deepcopy(chat_tokenizers["qwen"])
    tokenizer.chat_template = (
        "{%- if tools %}{{- 'Tools: ' + (tools | map(attribute='name') | join(', ')) + '\\n' }}{%- endif %}"
        "{%- if brief %}{{- 'Be brief.\\n' }}{%- endif %}" + tokenizer.chat_template
    )
    tools = [{"name": "add", "description": "Add two numbers."}]
    pair = {"prompt": USER, "chosen": GOOD, "rejected": BAD}
    pair.update(tools=json.dumps(tools), chat_template_kwargs={"brief": True})  # TRL's columns
    out = tokenize_preference(pair, tokenizer)
    expected = tokenizer.apply_chat_template(
        USER, tools=tools, brief=True, tokenize=True, add_generation_prompt=True, return_dict=True
    )["input_ids"]
    assert out["prompt_ids"] == list(expected)
    assert tokenizer.decode(out["prompt_ids"]).startswith("Tools: add\nBe brief.\n")


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
    end = tokenize_preference(example, tokenizer, max_prompt_length=6, prompt_truncation="keep_end")
    start = tokenize_preference(example, tokenizer, max_prompt_length=6, prompt_truncation="keep_start")
    assert end["prompt_ids"] == whole["prompt_ids"][-6:] and start["prompt_ids"] == whole["prompt_ids"][:6]
    assert end["chosen_ids"] == whole["chosen_ids"] and end["num_tokens"] == whole["num_tokens"]
    cut = tokenize_preference(example, tokenizer, max_length=8, max_prompt_length=6, prompt_truncation="keep_end")
    assert cut["chosen_ids"] == whole["chosen_ids"][:2] and cut["rejected_ids"] == whole["rejected_ids"][:2]
    full = tokenize_preference(example, tokenizer, max_length=len(whole["prompt_ids"]))  # the prompt fills it
    assert full["prompt_ids"] == whole["prompt_ids"] and full["chosen_ids"] == full["rejected_ids"] == []


def test_clear_errors_for_bad_pairs(tokenizer):
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


def test_datamodule_batches_pairs_and_counts_truncated_tokens(recwarn):
    data = datasets.Dataset.from_list([{"prompt": USER, "chosen": GOOD, "rejected": BAD}] * 6)
    dm = PreferenceDataModule(
        dataset=data, max_length=16, max_prompt_length=12, prompt_truncation="keep_end", batch_size=2, val_size=2
    )
    dm.setup("fit")
    assert len(dm.datasets["train"]) == 4 and len(dm.datasets["validation"]) == 2
    counts = dm.token_counts["train"]
    assert counts.truncated_tokens > 0 and counts.kept_tokens + counts.truncated_tokens == counts.tokens
    share = counts.truncated_tokens / counts.tokens
    cut = [str(w.message) for w in recwarn if str(w.message).startswith("train: ")]
    assert cut == [
        f"train: {100 * share:.1f}% of the tokens ({counts.truncated_tokens:,} of {counts.tokens:,}) are cut past "
        "max_length=16. Keep them with a larger --data.max_length (lit-memtrain lengths profiles the pairs' sequences)."
    ] and share > 0.1
    batch = next(iter(dm.train_dataloader()))
    lengths = batch["cu_seq_lens_q"].diff()
    assert batch["input_ids"].shape[0] == 1 and batch["num_pairs"] == 2 and len(lengths) == 4
    assert len(dm.datasets["train"][0]["prompt_ids"]) == 12 and (lengths <= 16).all()
    assert lengths.sum() == batch["input_ids"].shape[1]


def test_datamodule_names_the_missing_column_and_refuses_a_prompt_length_without_room(tmp_path):
    missing = datasets.Dataset.from_list([{"prompt": "a", "chosen": "b"}])
    with pytest.raises(ValueError, match=r"\['rejected'\] is missing: the dataset has columns \['prompt', 'chosen'\]"):
        PreferenceDataModule(dataset=missing).setup("fit")
    with pytest.raises(ValueError, match="max_prompt_length must be at least 1 and below max_length=16"):
        PreferenceDataModule(max_length=16, max_prompt_length=16, prompt_truncation="keep_end")


# (prompt, chosen, rejected) and their tokens with the embedded tokenizer (an eos closes each completion); at
# max_length=9 each row is one edge of TRL's truncation.
EDGES = [
    ("What is 2 + 3?", " It is 5.", " 6"),  # 6 + 7 and 6 + 2: chosen cut to 3 tokens, rejected whole
    ("Say hi.", " hi", " bye"),  # 6 + 3 fits exactly, 6 + 4 loses only its eos
    ("What is 12 + 30?", " 42", " 41"),  # a prompt of 8: one completion token each
    ("Sort the letters of dcba.", " abcd", " abdc"),  # a prompt of 9 = max_length: dropped
    ("Reverse cat.", " tac", " cta"),  # 5 + 3 and 5 + 4: whole
    ("Name a color.", " red", " blue"),  # a prompt of 10: dropped
]


def _pairs(rows) -> datasets.Dataset:
    return datasets.Dataset.from_list([{"prompt": p, "chosen": c, "rejected": r} for p, c, r in rows])


def test_max_length_truncates_and_drops_as_trl_dpo_trainer_does(tokenizer, tmp_path):
    """TRL's max_length with truncation_mode='keep_start' (its default): each sequence keeps its first max_length
    tokens, the eos counted, chosen and rejected each cut to its own length, and a pair whose prompt alone fills
    max_length is dropped. The same pairs and the same sequences here (this used to stop the whole map)."""
    from transformers import AutoModelForCausalLM
    from trl import DPOConfig, DPOTrainer

    from lit_memtrain.models.presets import build_config

    config = build_config("tiny-qwen3", {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                                         "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
                                         "vocab_size": len(tokenizer)})
    args = DPOConfig(output_dir=str(tmp_path), max_length=9, report_to=[], use_cpu=True, bf16=False)
    assert args.truncation_mode == "keep_start"
    model, reference = AutoModelForCausalLM.from_config(config), AutoModelForCausalLM.from_config(config)
    trl = DPOTrainer(
        model=model, ref_model=reference, args=args, train_dataset=_pairs(EDGES), processing_class=tokenizer
    )
    dm = PreferenceDataModule(dataset=_pairs(EDGES), max_length=9, padding_free=False, batch_size=8)
    dm.setup("fit")
    train = dm.datasets["train"]
    assert len(train) == len(trl.train_dataset) == 4 and dm.token_counts["train"].dropped_examples == 2
    assert train["prompt_ids"] == trl.train_dataset["prompt_ids"]
    theirs = trl.data_collator([trl.train_dataset[i] for i in range(4)])
    ours = dm.collator()([train[i] for i in range(4)])
    for row in range(8):
        their_tokens = theirs["input_ids"][row][theirs["attention_mask"][row] == 1]
        assert ours["input_ids"][row][ours["attention_mask"][row] == 1].tolist() == their_tokens.tolist()
        assert (ours["labels"][row] != -100).tolist() == (theirs["completion_mask"][row] == 1).tolist()
    completions = [len(train[i]["chosen_ids"]) for i in range(4)] + [len(train[i]["rejected_ids"]) for i in range(4)]
    assert completions == [3, 3, 1, 3, 2, 3, 1, 4]  # the edges above, as TRL cuts them
    eos = tokenizer.eos_token_id
    assert train[1]["rejected_ids"][-1] != eos and train[0]["rejected_ids"][-1] == eos  # the eos counts, and is cut


def test_pairs_that_cannot_fit_are_dropped_counted_and_logged_once_per_split(tmp_path, tokenizer):
    (tmp_path / "train.jsonl").write_text("".join(
        '{"prompt": "%s", "chosen": "%s", "rejected": "%s"}\n' % row for row in EDGES
    ))
    (tmp_path / "validation.jsonl").write_text("".join(
        '{"prompt": "%s", "chosen": "%s", "rejected": "%s"}\n' % row for row in EDGES[:4]
    ))
    dm = PreferenceDataModule(dataset=str(tmp_path), max_length=9, val_split="validation")
    with pytest.warns(UserWarning) as record:
        dm.setup("fit")
    dropped = [str(w.message) for w in record if str(w.message).startswith("Dropped")]
    assert len(dropped) == 2 and dropped[0].startswith("Dropped 2 of 6 train pairs whose prompt alone has max_length=9")
    assert dropped[1].startswith("Dropped 1 of 4 validation pairs") and "Set max_prompt_length" in dropped[0]
    counts = dm.token_counts["train"]
    whole = [tokenize_preference(dict(zip(("prompt", "chosen", "rejected"), row)), tokenizer) for row in EDGES]
    assert (counts.examples, counts.dropped_examples) == (6, 2)
    assert counts.dropped_tokens == whole[3]["num_tokens"] + whole[5]["num_tokens"]
    assert counts.kept_tokens == 9 + 9 + 9 + 9 + 9 + 8 + 8 + 9
    assert counts.kept_tokens + counts.truncated_tokens + counts.dropped_tokens == counts.tokens
    assert [len(ids) for ids in dm.datasets["train"]["prompt_ids"]] == [6, 6, 8, 5]
    assert len(dm.datasets["validation"]) == 3
    with pytest.raises(ValueError, match=r"The train dataset .*is empty after dropping pairs: the prompts of all 2"):
        PreferenceDataModule(dataset=_pairs([EDGES[3], EDGES[5]]), max_length=9).setup("fit")
    kept = PreferenceDataModule(dataset=_pairs(EDGES), max_length=9, max_prompt_length=8, prompt_truncation="keep_end")
    kept.setup("fit")  # long prompts cut instead: nothing dropped
    assert len(kept.datasets["train"]) == 6 and kept.token_counts["train"].dropped_examples == 0


def test_a_config_of_the_old_truncation_mode_fails_with_the_fix_rather_than_changing_meaning():
    """truncation_mode used to pick the prompt tokens max_prompt_length keeps ('keep_end' by default); it now
    follows TRL (the whole sequence, 'keep_start'). Neither old usage may silently keep the other end of prompts."""
    from lit_memtrain.cli import MemTrainCLI
    from lit_memtrain.objectives.causal_lm import CausalLMModule

    with pytest.raises(ValueError, match=r"truncation_mode='keep_end' is not supported\. truncation_mode is TRL's "
                                         r"\(DPOConfig\).* that is now prompt_truncation"):
        PreferenceDataModule(truncation_mode="keep_end")
    with pytest.raises(ValueError, match="max_prompt_length=48 cuts long prompts: set prompt_truncation to the tokens"):
        PreferenceDataModule(max_length=64, max_prompt_length=48, truncation_mode="keep_start")
    with pytest.raises(ValueError, match="prompt_truncation must be 'keep_end' or 'keep_start', got 'left'"):
        PreferenceDataModule(max_length=64, max_prompt_length=48, prompt_truncation="left")
    with pytest.raises(ValueError, match="max_prompt_length=48 cuts long prompts"):  # configs/dpo.yaml, written before
        MemTrainCLI(
            CausalLMModule, PreferenceDataModule, subclass_mode_model=True, subclass_mode_data=True, run=False,
            args=["--config", str(DPO_CONFIG), "--data.prompt_truncation=null", "--data.truncation_mode=keep_start"],
        )


def test_lengths_reports_the_pairs_training_drops_at_max_length(tmp_path, capsys):
    from lit_memtrain.cli import main

    path = tmp_path / "pairs.jsonl"
    path.write_text("".join('{"prompt": "%s", "chosen": "%s", "rejected": "%s"}\n' % row for row in EDGES))
    main(["lengths", "--config", str(DPO_CONFIG), f"--data.dataset={path}", "--data.max_length=9",
          "--data.max_prompt_length=null", "--candidates=[9, 16]", f"--histogram={tmp_path / 'lengths.png'}"])
    out = capsys.readouterr().out
    trained = PreferenceDataModule(dataset=str(path), max_length=9)
    trained.setup("fit")
    dropped = trained.token_counts["train"]
    assert f"At max_length=9 training drops 2 of 6 pairs ({dropped.dropped_tokens:,} tokens)" in out
    assert dropped.dropped_examples == 2 and "cut to max_prompt_length" not in out


def test_a_row_of_an_explicit_prompt_dataset_without_its_prompt_is_an_error_not_an_extracted_prompt(tokenizer):
    """With a prompt column, a row whose prompt is missing (None) used to fall back to implicit extraction: the
    shared prefix of its completions ("The answer is 4") became the prompt, trained silently on "2" against "1"."""
    with pytest.raises(ValueError, match="the row has no 'prompt' value"):
        tokenize_preference({"prompt": None, "chosen": "The answer is 42", "rejected": "The answer is 41"}, tokenizer)
