"""PromptDataModule through the datamodule: TRL's prompt-only formats tokenized as TRL's GRPOTrainer does, the other
columns kept for the reward functions, prompts cut to max_prompt_length and counted in the log, clear errors."""

from __future__ import annotations

import copy
import json
import logging
import random

import datasets
import pytest

from lit_memtrain.datamodules.embedded import make_arithmetic_prompt
from lit_memtrain.datamodules.prompts import PromptCounts, PromptDataModule

QUESTIONS = ["What is 2 + 3?", "Reverse the word abc, please, and be quick about it."]


def _standard() -> datasets.Dataset:
    return datasets.Dataset.from_list(
        [{"prompt": q, "answer": str(i), "completion": "unused", "level": i} for i, q in enumerate(QUESTIONS)]
    )


def _conversational() -> datasets.Dataset:
    return datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": q}], "answer": str(i)}
                                       for i, q in enumerate(QUESTIONS)])


def _loaded(dataset, tokenizer="lit-memtrain/embedded", max_prompt_length=None, **kwargs) -> tuple:
    datamodule = PromptDataModule(tokenizer=tokenizer, dataset=dataset, batch_size=2,
                                  max_prompt_length=max_prompt_length, **kwargs)
    datamodule.setup("fit")
    return datamodule, next(iter(datamodule.train_dataloader()))


def _rows(batch: dict) -> list[tuple]:
    return sorted(zip(map(str, batch["prompt"]), map(tuple, batch["prompt_ids"]), batch["columns"]["answer"]))


def test_standard_and_conversational_prompts_tokenize_as_trl(tokenizer, chat_tokenizers, tmp_path):
    _, batch = _loaded(_standard())
    assert _rows(batch) == sorted((q, tuple(tokenizer(text=q)["input_ids"]), str(i)) for i, q in enumerate(QUESTIONS))
    assert set(batch["columns"]) == {"answer", "level"}  # 'completion' is what is generated, not data
    _, batch = _loaded(_conversational())
    expected = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                              tokenize=True, return_dict=True)["input_ids"] for q in QUESTIONS]
    assert sorted(map(tuple, batch["prompt_ids"])) == sorted(map(tuple, expected))
    assert all(isinstance(prompt, list) and prompt[0]["role"] == "user" for prompt in batch["prompt"])
    llama = chat_tokenizers["llama"]  # adds a BOS token to text, as TRL's tokenizer(text=...) call does
    directory = tmp_path / "llama"
    llama.save_pretrained(directory)
    _, batch = _loaded(_standard(), tokenizer=str(directory))
    assert all(ids[0] == llama.bos_token_id for ids in batch["prompt_ids"])


@pytest.mark.parametrize("prompt_truncation", ["keep_end", "keep_start"])
def test_long_prompts_are_cut_counted_and_logged(tokenizer, caplog, recwarn, prompt_truncation):
    lengths = [len(tokenizer(text=q)["input_ids"]) for q in QUESTIONS]
    limit = min(lengths) + 2  # the first prompt fits, the second is cut
    with caplog.at_level(logging.INFO):
        datamodule, batch = _loaded(_standard(), max_prompt_length=limit, prompt_truncation=prompt_truncation)
    assert datamodule.prompt_counts["train"] == PromptCounts(
        prompts=2, tokens=sum(lengths), truncated_prompts=1, truncated_tokens=max(lengths) - limit
    )
    assert f"1 prompts longer than max_prompt_length={limit} cut by {max(lengths) - limit} tokens" in caplog.text
    cut, total = max(lengths) - limit, sum(lengths)  # 24 of 38 tokens: more than a tenth, a warning
    assert cut * 10 > total and [str(w.message) for w in recwarn if "are cut past" in str(w.message)] == [
        f"train prompts: {100 * cut / total:.1f}% of the tokens ({cut:,} of {total:,}) are cut past "
        f"max_prompt_length={limit}. Keep them with a larger --data.max_prompt_length, or none (max_prompt_length: "
        "null)."
    ]
    full = tokenizer(text=QUESTIONS[1])["input_ids"]
    cut = next(ids for ids, answer in zip(batch["prompt_ids"], batch["columns"]["answer"]) if answer == "1")
    assert cut == (full[-limit:] if prompt_truncation == "keep_end" else full[:limit])


def test_embedded_prompts_and_held_out_validation():
    datamodule = PromptDataModule(batch_size=4, val_size=8, max_prompt_length=64)
    datamodule.setup("fit")
    assert len(datamodule.datasets["validation"]) == 8 and len(datamodule.datasets["train"]) == 1992
    batch = next(iter(datamodule.train_dataloader()))
    assert len(batch["prompt_ids"]) == 4 and set(batch["columns"]) == {"answer"}
    question = batch["prompt"][0][0]["content"]
    a, b = (int(x) for x in question.removeprefix("What is ").removesuffix("?").split(" + "))
    assert batch["columns"]["answer"][0] == str(a + b)
    assert datamodule.prompt_counts["train"].truncated_prompts == 0


def test_bad_data_is_refused_with_where_it_is(tmp_path):
    with pytest.raises(ValueError, match="needs a 'prompt' column"):
        _loaded(datasets.Dataset.from_list([{"question": "2 + 2"}]))
    with pytest.raises(ValueError, match=r"\['completions'\] would be passed to the reward functions"):
        _loaded(datasets.Dataset.from_list([{"prompt": "2 + 2", "completions": "4"}]))
    path = tmp_path / "prompts.jsonl"
    rows = [make_arithmetic_prompt(random.Random(0)), {"prompt": "", "answer": "0"}]
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    with pytest.raises(ValueError, match=rf"{path} line 2: .*no tokens"):
        _loaded(str(path))
    with pytest.raises(ValueError, match="max_prompt_length"):
        PromptDataModule(max_prompt_length=0)
    with pytest.raises(ValueError, match="prompt_truncation"):
        PromptDataModule(prompt_truncation="middle")


def test_prompts_are_tokenized_whole_by_default_as_trl(tokenizer):
    """TRL 1.16's GRPOTrainer has no prompt cut: a prompt of more than the old 512-token default is kept whole."""
    long_prompt = "What is 12 + 34? " * 120
    full = tokenizer(text=long_prompt)["input_ids"]
    datamodule = PromptDataModule(dataset=datasets.Dataset.from_list([{"prompt": long_prompt}]), batch_size=1)
    datamodule.setup("fit")
    assert len(full) > 512 and next(iter(datamodule.train_dataloader()))["prompt_ids"] == [full]
    assert datamodule.prompt_counts["train"].truncated_prompts == 0


@pytest.mark.parametrize("drop_last", [True, False])
def test_an_epochs_incomplete_batch_is_dropped_as_trls_sampler_drops_it(drop_last):
    from trl.trainer.grpo_trainer import RepeatSampler

    data = datasets.Dataset.from_list([{"prompt": f"question {i}", "index": i} for i in range(7)])
    datamodule = PromptDataModule(dataset=data, batch_size=3, drop_last=drop_last)
    datamodule.setup("fit")
    batches = [batch["columns"]["index"] for batch in datamodule.train_dataloader()]
    trl = list(RepeatSampler(range(7), mini_repeat_count=1, batch_size=3, repeat_count=1, shuffle=True, seed=0))
    if drop_last:  # TRL's: the whole batches only, each prompt once
        assert [len(b) for b in batches] == [3, 3] and len(trl) == 6 and len({i for b in batches for i in b}) == 6
    else:
        assert [len(b) for b in batches] == [3, 3, 1] and sorted(i for b in batches for i in b) == list(range(7))
    with pytest.raises(ValueError, match=r"has 2 prompts, fewer than one whole batch \(batch_size=3 x 1 ranks\)"):
        small = PromptDataModule(dataset=data.select(range(2)), batch_size=3)
        small.setup("fit")
        small.train_dataloader()


def test_chat_template_kwargs_render_prompts_as_trls_grpo_trainer(tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    from lit_memtrain.models.presets import build_config

    thinking = copy.deepcopy(tokenizer)  # a Qwen3-style switch after the generation prompt
    thinking.chat_template += "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
    thinking.save_pretrained(tmp_path / "thinking")
    options = {"enable_thinking": False}
    _, batch = _loaded(_conversational(), tokenizer=str(tmp_path / "thinking"), chat_template_kwargs=options)
    model = AutoModelForCausalLM.from_config(build_config("tiny-qwen3", {"hidden_size": 16, "intermediate_size": 32,
        "num_hidden_layers": 1, "num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": 16}))  # fmt: skip
    config = GRPOConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, report_to=[], chat_template_kwargs=options,
                        per_device_train_batch_size=2, num_generations=2)  # fmt: skip
    trl = GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=config,
                      train_dataset=_conversational(), processing_class=thinking)  # fmt: skip
    theirs, _, _ = trl._tokenize_prompts([[{"role": "user", "content": q}] for q in QUESTIONS])
    plain = [thinking.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                          return_dict=True)["input_ids"] for q in QUESTIONS]  # fmt: skip
    assert all(isinstance(ids[0], int) for ids in plain)
    assert sorted(map(tuple, batch["prompt_ids"])) == sorted(map(tuple, theirs)) != sorted(map(tuple, plain))
    with pytest.raises(TypeError, match="chat_template_kwargs must be a dict"):
        PromptDataModule(chat_template_kwargs="enable_thinking=False")
