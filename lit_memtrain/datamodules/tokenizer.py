"""Loading a tokenizer by hub id, local path, GGUF file or the embedded default, with a usable pad token."""

from __future__ import annotations

import warnings

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from lit_memtrain.datamodules.embedded import EMBEDDED, embedded_tokenizer_path
from lit_memtrain.datamodules.gguf_files import find_gguf
from lit_memtrain.datamodules.hub_access import require_hub


def load_tokenizer(name_or_path: str, gguf_file: str | None = None) -> PreTrainedTokenizerBase:
    """Load a tokenizer; ``"lit-memtrain/embedded"`` builds the offline default on first use.

    A GGUF file's own tokenizer (and chat template) is read from a ``.gguf`` path, a packaged model's short name
    (``smollm2-135m-instruct``), or a directory or hub id with ``gguf_file``
    (:func:`~lit_memtrain.datamodules.gguf_files.find_gguf`).

    A tokenizer without a pad token gets its eos token as pad token, with a warning: padding positions are
    masked out of attention and loss, so the choice does not change training.
    """
    gguf = find_gguf(name_or_path, gguf_file)
    if gguf is not None:
        require_hub(gguf.location, "tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(gguf.location, gguf_file=gguf.name)
    else:
        path = embedded_tokenizer_path() if name_or_path == EMBEDDED else name_or_path
        require_hub(str(path), "tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(f"Tokenizer {name_or_path!r} has neither a pad token nor an eos token to pad with.")
        warnings.warn(
            f"Tokenizer {name_or_path!r} has no pad token; using its eos token {tokenizer.eos_token!r} for padding.",
            stacklevel=2,
        )
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
