"""The embedded default: a tokenizer, a conversational dataset, a preference dataset and a prompt set made offline.

Why: the quickstart and the tests must run on a machine that cannot reach a model hub. We generate
small, learnable chat tasks (two-digit addition, reversing and sorting words), train a byte-level BPE
tokenizer on them with the ``tokenizers`` library and give it a ChatML template. Both are written to a
local directory and then loaded through the ordinary ``from_pretrained`` / ``load_dataset`` code, so the
real loading path is what runs.
"""

from __future__ import annotations

import json
import random
import string
from collections.abc import Iterable
from pathlib import Path

EMBEDDED = "lit-memtrain/embedded"
"""Pass as ``tokenizer`` or ``dataset`` to use the embedded default."""

ADDITION = "lit-memtrain/addition"
"""A dataset: two-digit additions as conversations (``messages``), none a question of :data:`ADDITION_HELDOUT`."""

ADDITION_HELDOUT = "lit-memtrain/addition-heldout"
"""A dataset: held-out two-digit additions as prompts with their exact ``answer``, to score a model trained on
:data:`ADDITION` on questions it never saw."""

ADDITION_PROMPTS = "lit-memtrain/addition-prompts"
"""A prompt dataset (online RL): additions asked by :data:`ADDITION` only, as prompts with their exact ``answer``."""

ADDITION_PAIRS = "lit-memtrain/addition-pairs"
"""A preference dataset (a ``save_to_disk`` directory): a ``train`` split of additions asked by :data:`ADDITION`
and a ``heldout`` split of those of :data:`ADDITION_HELDOUT`, each with the right sum chosen over a wrong one."""

_ADDITION_HELDOUT_PAIRS = 500  # of the 10,000 (a, b) pairs, held out of ADDITION

_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}"
    "{{ '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""ChatML, with ``{% generation %}`` marks so assistant tokens can be masked exactly."""


def default_cache_dir() -> Path:
    """Where the embedded tokenizer and data live: ``$LIT_MEMTRAIN_HOME`` or ``~/.cache/lit-memtrain``."""
    import os

    return Path(os.environ.get("LIT_MEMTRAIN_HOME", Path.home() / ".cache" / "lit-memtrain"))


def _random_word(rng: random.Random) -> str:
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 7)))


def make_conversation(rng: random.Random) -> list[dict[str, str]]:
    """One user question and its exact answer, from one of three tasks."""
    task = rng.randrange(3)
    if task == 0:
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        question, answer = f"What is {a} + {b}?", str(a + b)
    elif task == 1:
        word = _random_word(rng)
        question, answer = f"Reverse the word {word}.", word[::-1]
    else:
        word = _random_word(rng)
        question, answer = f"Sort the letters of {word}.", "".join(sorted(word))
    return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]


def _wrong_answer(rng: random.Random, answer: str) -> str:
    """A plausible wrong answer to one of :func:`make_conversation`'s questions: off by a little, or scrambled."""
    if answer.isdigit():
        return str(int(answer) + rng.choice([-1, 1]) * rng.randint(1, 9)).lstrip("-")
    letters = list(answer)
    for _ in range(10):
        rng.shuffle(letters)
        if "".join(letters) != answer:
            return "".join(letters)
    return answer + rng.choice(string.ascii_lowercase)  # every letter the same: one too many is still wrong


def make_preference(rng: random.Random) -> dict[str, list[dict[str, str]]]:
    """One preference pair in TRL's conversational explicit-prompt format: the exact answer is chosen over a wrong one."""
    user, assistant = make_conversation(rng)
    return _preference(rng, user, assistant["content"])


def _preference(rng: random.Random, user: dict[str, str], answer: str) -> dict[str, list[dict[str, str]]]:
    """``answer`` chosen over a wrong answer to ``user``'s question."""
    wrong = _wrong_answer(rng, answer)
    while wrong == answer:
        wrong = _wrong_answer(rng, answer)
    return {
        "prompt": [user],
        "chosen": [{"role": "assistant", "content": answer}],
        "rejected": [{"role": "assistant", "content": wrong}],
    }


def make_arithmetic_prompt(rng: random.Random) -> dict[str, object]:
    """One prompt of online RL's embedded task in TRL's conversational prompt-only format: a two-digit addition
    and, in an ``answer`` column the reward functions read, its exact result."""
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    return {"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}], "answer": str(a + b)}


def _addition_pairs(seed: int = 3) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Every two-digit pair ``(a, b)``, shuffled and cut in two: the training pairs and the held-out pairs."""
    pairs = [(a, b) for a in range(100) for b in range(100)]
    random.Random(seed).shuffle(pairs)
    return pairs[_ADDITION_HELDOUT_PAIRS:], pairs[:_ADDITION_HELDOUT_PAIRS]


def _addition(a: int, b: int) -> tuple[dict[str, str], str]:
    return {"role": "user", "content": f"What is {a} + {b}?"}, str(a + b)


def write_addition_dataset(path: Path, num_examples: int = 6000, seed: int = 4) -> Path:
    """Write ``num_examples`` addition conversations (``messages``), drawn from the training pairs only."""
    rng = random.Random(seed)
    training = _addition_pairs()[0]
    rows = []
    for a, b in (rng.choice(training) for _ in range(num_examples)):
        user, answer = _addition(a, b)
        rows.append({"messages": [user, {"role": "assistant", "content": answer}]})
    return _write_json_lines(path, rows)


def write_addition_heldout(path: Path) -> Path:
    """Write the held-out additions as prompts with their ``answer`` (TRL's conversational prompt-only format)."""
    return _write_json_lines(path, (_addition_prompt(a, b) for a, b in _addition_pairs()[1]))


def write_addition_prompts(path: Path, num_examples: int = 2000, seed: int = 6) -> Path:
    """Write ``num_examples`` additions drawn from the training pairs as prompts with their ``answer``."""
    rng = random.Random(seed)
    training = _addition_pairs()[0]
    return _write_json_lines(path, (_addition_prompt(*rng.choice(training)) for _ in range(num_examples)))


def _addition_prompt(a: int, b: int) -> dict[str, object]:
    user, answer = _addition(a, b)
    return {"prompt": [user], "answer": answer}


def write_addition_preferences(directory: Path, num_examples: int = 4000, seed: int = 5) -> Path:
    """Write :data:`ADDITION_PAIRS` to ``directory``: ``num_examples`` training pairs drawn from the training
    additions, and one pair per held-out addition (the ``heldout`` split), in that order. The wrong sum is off by
    1 to 9, as in the embedded preference set. Written beside ``directory`` and renamed: a reader never sees half."""
    import shutil

    import datasets

    rng = random.Random(seed)
    training, heldout = _addition_pairs()
    train = [_preference(rng, *_addition(*rng.choice(training))) for _ in range(num_examples)]
    splits = datasets.DatasetDict(
        train=datasets.Dataset.from_list(train),
        heldout=datasets.Dataset.from_list([_preference(rng, *_addition(a, b)) for a, b in heldout]),
    )
    tmp = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    splits.save_to_disk(str(tmp))
    tmp.replace(directory)
    return directory


def write_embedded_prompts(path: Path, num_examples: int = 2000, seed: int = 2) -> Path:
    """Write ``num_examples`` arithmetic prompts as JSON lines (``prompt`` and ``answer`` per line)."""
    rng = random.Random(seed)
    return _write_json_lines(path, (make_arithmetic_prompt(rng) for _ in range(num_examples)))


def write_embedded_preferences(path: Path, num_examples: int = 2000, seed: int = 1) -> Path:
    """Write ``num_examples`` preference pairs as JSON lines (``prompt``, ``chosen``, ``rejected`` per line)."""
    rng = random.Random(seed)
    return _write_json_lines(path, (make_preference(rng) for _ in range(num_examples)))


def write_embedded_dataset(path: Path, num_examples: int = 6000, seed: int = 0) -> Path:
    """Write ``num_examples`` conversations as JSON lines (one ``messages`` list per line)."""
    rng = random.Random(seed)
    return _write_json_lines(path, ({"messages": make_conversation(rng)} for _ in range(num_examples)))


def _write_json_lines(path: Path, rows: Iterable[dict]) -> Path:
    """Write ``rows`` to ``path`` as JSON lines, through a temporary file: a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with tmp.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    tmp.replace(path)
    return path


def write_embedded_tokenizer(directory: Path, vocab_size: int = 384, seed: int = 0) -> Path:
    """Train a byte-level BPE tokenizer on generated conversations and save it as a HF tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(seed)
    corpus = []
    for _ in range(4000):
        for message in make_conversation(rng):
            corpus.append(f"<|im_start|>{message['role']}\n{message['content']}<|im_end|>\n")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(corpus, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(directory))
    return directory


def embedded_tokenizer_path(cache_dir: Path | None = None) -> str:
    """Directory of the embedded tokenizer, created on first use."""
    directory = (cache_dir or default_cache_dir()) / "tokenizer"
    if not (directory / "tokenizer.json").exists():
        write_embedded_tokenizer(directory)
    return str(directory)


def embedded_dataset_path(cache_dir: Path | None = None) -> str:
    """JSON-lines file of the embedded conversational dataset, created on first use."""
    path = (cache_dir or default_cache_dir()) / "conversations.jsonl"
    if not path.exists():
        write_embedded_dataset(path)
    return str(path)


def embedded_preference_path(cache_dir: Path | None = None) -> str:
    """JSON-lines file of the embedded preference dataset, created on first use."""
    path = (cache_dir or default_cache_dir()) / "preferences.jsonl"
    if not path.exists():
        write_embedded_preferences(path)
    return str(path)


def embedded_prompt_path(cache_dir: Path | None = None) -> str:
    """JSON-lines file of the embedded arithmetic prompts (online RL), created on first use."""
    path = (cache_dir or default_cache_dir()) / "prompts.jsonl"
    if not path.exists():
        write_embedded_prompts(path)
    return str(path)


_NAMED_FILES = {
    ADDITION: ("addition.jsonl", write_addition_dataset),
    ADDITION_HELDOUT: ("addition_heldout.jsonl", write_addition_heldout),
    ADDITION_PROMPTS: ("addition_prompts.jsonl", write_addition_prompts),
    ADDITION_PAIRS: ("addition_pairs", write_addition_preferences),
}


def named_dataset_file(dataset: str) -> str:
    """The file of :data:`ADDITION`, :data:`ADDITION_HELDOUT`, :data:`ADDITION_PROMPTS` or :data:`ADDITION_PAIRS` (created on first use);
    any other ``dataset`` unchanged."""
    if dataset not in _NAMED_FILES:
        return dataset
    name, write = _NAMED_FILES[dataset]
    path = default_cache_dir() / name
    if not path.exists():
        write(path)
    return str(path)
