"""The addition pairs (lit-memtrain/addition-pairs) and prompts (lit-memtrain/addition-prompts): exact counts, the
right sum chosen (or given as the answer) and a wrong one rejected, and no held-out question among the training rows."""

from lit_memtrain.datamodules.embedded import ADDITION_HELDOUT, ADDITION_PAIRS, ADDITION_PROMPTS
from lit_memtrain.datamodules.sources import load_raw_dataset
from lit_memtrain.objectives.answer_accuracy import load_answer_prompts


def _sum(question: str) -> int:
    a, b = question.removeprefix("What is ").removesuffix("?").split(" + ")
    return int(a) + int(b)


def _held_out_questions() -> set[str]:
    return {row["prompt"][0]["content"] for row in load_answer_prompts(ADDITION_HELDOUT, 500)}


def test_pairs_choose_the_right_sum_and_hold_out_the_held_out_questions():
    splits = load_raw_dataset(ADDITION_PAIRS).data
    assert {name: len(split) for name, split in splits.items()} == {"train": 4000, "heldout": 500}
    questions = {}
    for name, split in splits.items():
        questions[name] = set()
        for row in split:
            (user,), (chosen,), (rejected,) = row["prompt"], row["chosen"], row["rejected"]
            assert (user["role"], chosen["role"], rejected["role"]) == ("user", "assistant", "assistant")
            assert chosen["content"] == str(_sum(user["content"])) != rejected["content"]
            assert 1 <= abs(int(rejected["content"]) - int(chosen["content"])) <= 9
            questions[name].add(user["content"])
    held_out = _held_out_questions()
    assert questions["heldout"] == held_out and not questions["train"] & held_out


def test_training_prompts_carry_their_sum_and_never_ask_a_held_out_question():
    rows = load_answer_prompts(ADDITION_PROMPTS, 2000)
    assert all(row["answer"] == str(_sum(row["prompt"][0]["content"])) for row in rows)
    assert not {row["prompt"][0]["content"] for row in rows} & _held_out_questions()
