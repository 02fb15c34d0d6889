"""Exact-answer accuracy by greedy generation: batched answers equal each prompt's own, scores count exact answers,
and the held-out additions are questions the training additions never ask."""

import copy
import json

import pytest
import torch
from gguf_writer import tiny_llama

from lit_memtrain.datamodules.embedded import ADDITION, ADDITION_HELDOUT, EMBEDDED, named_dataset_file
from lit_memtrain.models.generate import greedy_completions, model_inputs
from lit_memtrain.objectives.answer_accuracy import AnswerScore, load_answer_prompts, score_exact_answers


def _questions(dataset: str, key: str) -> set[str]:
    with open(named_dataset_file(dataset)) as file:
        return {json.loads(line)[key][0]["content"] for line in file}


def test_the_held_out_additions_are_never_asked_in_training():
    held_out, training = _questions(ADDITION_HELDOUT, "prompt"), _questions(ADDITION, "messages")
    assert len(held_out) == 500 and len(training) > 4000 and not held_out & training
    rows = load_answer_prompts(ADDITION_HELDOUT, 200)
    question = rows[0]["prompt"][0]["content"]
    a, b = map(int, question.removeprefix("What is ").removesuffix("?").split(" + "))
    assert len(rows) == 200 and rows[0]["answer"] == str(a + b)


def _alone(model, tokenizer, prompt, max_new_tokens):
    text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    encoded = tokenizer(text, return_tensors="pt", add_special_tokens=False)
    output = model.generate(**model_inputs(model, dict(encoded)), max_new_tokens=max_new_tokens, do_sample=False,
                            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    return tokenizer.decode(output[0, encoded["input_ids"].shape[1]:], skip_special_tokens=True)


def test_batched_greedy_answers_equal_each_prompts_own_and_are_scored_exactly(tokenizer):
    model = tiny_llama().train()
    rows = load_answer_prompts(ADDITION_HELDOUT, 12)  # questions of different token lengths: left padding in a batch
    with torch.no_grad():
        alone = [_alone(model.eval(), tokenizer, row["prompt"], 5) for row in rows]
    model.train()
    assert greedy_completions(model, tokenizer, [row["prompt"] for row in rows], 5, batch_size=5) == alone
    assert model.training and tokenizer.padding_side == "right"
    answered = [
        {**row, "answer": answer.strip() if i % 3 else "wrong"} for i, (row, answer) in enumerate(zip(rows, alone))
    ]
    assert score_exact_answers(model, tokenizer, answered, 5, batch_size=5) == AnswerScore(8, 12)


def test_prompts_without_answers_are_refused(tmp_path):
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps({"prompt": "What is 1 + 1?"}) + "\n")
    with pytest.raises(ValueError, match=r"has no 'answer' column \(its columns: \['prompt'\]\)"):
        load_answer_prompts(str(path), 1)
    with pytest.raises(ValueError, match="has 500 prompts, fewer than num_prompts=501"):
        load_answer_prompts(ADDITION_HELDOUT, 501)


def _bos_tokenizer():
    """The embedded tokenizer as a Llama-style one: it puts a BOS token before every text, and has no chat
    template."""
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    from lit_memtrain.datamodules.embedded import embedded_tokenizer_path

    backend = PreTrainedTokenizerFast.from_pretrained(embedded_tokenizer_path()).backend_tokenizer
    bos = backend.token_to_id("<|im_start|>")
    backend.post_processor = TemplateProcessing(single="<|im_start|> $A", special_tokens=[("<|im_start|>", bos)])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )


def _prompted_with(model):
    """Record the unpadded prompt ids of each row ``model.generate`` is called with."""
    prompted, generate = [], model.generate

    def recording(**inputs):
        for ids, mask in zip(inputs["input_ids"], inputs["attention_mask"]):
            prompted.append(ids[mask.bool()].tolist())
        return generate(**inputs)

    model.generate = recording
    return prompted


def test_string_prompts_are_generated_from_the_tokens_training_gave_them_bos_first():
    from lit_memtrain.datamodules.prompt_tokenize import tokenize_prompt
    from lit_memtrain.datamodules.tokenize import tokenize_prompt_completion
    from lit_memtrain.models.generate import generate_answer

    tokenizer = _bos_tokenizer()
    prompts = ["What is 2 + 3?", "What is 41 + 17?"]
    rl_prompts = [tokenize_prompt({"prompt": prompt}, tokenizer)["prompt_ids"] for prompt in prompts]
    sft_rows = [tokenize_prompt_completion({"prompt": p, "completion": " 5"}, tokenizer) for p in prompts]
    sft_prompts = [row["input_ids"][: row["labels"].count(-100)] for row in sft_rows]
    assert rl_prompts == sft_prompts and all(ids[0] == tokenizer.bos_token_id for ids in rl_prompts)
    model = tiny_llama()
    prompted = _prompted_with(model)
    greedy_completions(model, tokenizer, prompts, 3, batch_size=2)
    assert prompted == rl_prompts  # both rows of one left-padded batch
    prompted.clear()
    generate_answer(model, prompts[1], 3, tokenizer=tokenizer)  # no chat template: the prompt as it was trained
    assert prompted == rl_prompts[1:]


def test_completions_end_at_an_end_of_turn_token_the_models_generation_config_names(tokenizer):
    """A chat model whose turns end with a token other than the tokenizer's eos (Gemma's <end_of_turn>, listed in its
    generation_config.eos_token_id beside <eos>) stops there, as online RL's generation does; generating past it
    appended the next turn to the answer, which the exact-answer check then scored wrong."""
    from transformers import AutoModelForCausalLM
    from tiny_models import TINY_OVERRIDES

    from lit_memtrain.models.generate import generate_answer
    from lit_memtrain.models.presets import build_config

    torch.manual_seed(0)  # untied: a random model with tied embeddings repeats one token
    overrides = {**TINY_OVERRIDES, "vocab_size": len(tokenizer), "tie_word_embeddings": False}
    model = AutoModelForCausalLM.from_config(build_config("tiny-qwen3", overrides)).eval()
    prompt = load_answer_prompts(ADDITION_HELDOUT, 1)[0]["prompt"]
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        unstopped = _alone_ids(model, tokenizer, prompt, 6)
    end_of_turn = unstopped[2]
    assert end_of_turn not in unstopped[:2] and end_of_turn != tokenizer.eos_token_id
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, end_of_turn]
    expected = tokenizer.decode(unstopped[:3], skip_special_tokens=True)
    assert expected != tokenizer.decode(unstopped, skip_special_tokens=True)
    assert greedy_completions(model, tokenizer, [prompt, prompt], 6, batch_size=2) == [expected, expected]
    assert generate_answer(model, prompt[0]["content"], 6, tokenizer=tokenizer) == expected


def _alone_ids(model, tokenizer, prompt, max_new_tokens):
    text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    encoded = tokenizer(text, return_tensors="pt", add_special_tokens=False)
    output = model.eval().generate(**model_inputs(model, dict(encoded)), max_new_tokens=max_new_tokens,
                                   do_sample=False, eos_token_id=None, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    return output[0, encoded["input_ids"].shape[1]:].tolist()


def test_prompts_are_rendered_with_the_chat_template_arguments_the_fit_trained_with(tokenizer, tmp_path):
    """A GRPO fit with PromptDataModule(chat_template_kwargs={"enable_thinking": False}) (Qwen3's) trains on prompts
    ending in an empty think block; ExactAnswerAccuracy rendered them without it, a prompt the model never saw."""
    from lightning.pytorch import Trainer

    from lit_memtrain.callbacks import ExactAnswerAccuracy
    from lit_memtrain.datamodules.prompt_tokenize import tokenize_prompt
    from lit_memtrain.datamodules.prompts import PromptDataModule

    thinking = copy.deepcopy(tokenizer)
    thinking.chat_template = tokenizer.chat_template.replace(
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}",
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
        "{% if enable_thinking is defined and not enable_thinking %}{{ 'no thought\n' }}{% endif %}{% endif %}",
    )
    off = {"enable_thinking": False}
    rows = load_answer_prompts(ADDITION_HELDOUT, 2)
    trained = [tokenize_prompt(row, thinking, chat_template_kwargs=off)["prompt_ids"] for row in rows]
    assert trained != [tokenize_prompt(row, thinking)["prompt_ids"] for row in rows]
    model = tiny_llama()
    prompted = _prompted_with(model)
    score_exact_answers(model, thinking, rows, 2, batch_size=2, chat_template_kwargs=off)
    assert prompted == trained
    # The callback takes them from the fit's datamodule, unless given.
    callback = ExactAnswerAccuracy(num_prompts=2)
    data = PromptDataModule(tokenizer=EMBEDDED, dataset=ADDITION_HELDOUT, chat_template_kwargs=off)
    trainer = Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.datamodule = data
    assert callback.template_arguments(trainer) == off
    assert ExactAnswerAccuracy(chat_template_kwargs={}).template_arguments(trainer) == {}
