"""A GGUF model's own tokenizer for the data, unless the config names another than the embedded default.

Why: ``lit-memtrain fit`` reads the tokenizer once, as ``data.tokenizer`` (linked to the model's), and its default is
the embedded offline tokenizer the random-weight presets train with. A pretrained model's token ids mean nothing in
another tokenizer's vocabulary, yet the embedded one fits inside a large vocabulary and would train silently on
nonsense. A GGUF file carries its tokenizer (and chat template), so a run that names a GGUF model
(``model: smollm2-135m-instruct``, a ``.gguf`` path, or ``gguf_file`` in ``model_init_kwargs``) and leaves
``data.tokenizer`` at the embedded default reads the file's, and says so in one line.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

from lit_memtrain.datamodules.embedded import EMBEDDED
from lit_memtrain.datamodules.gguf_files import find_gguf

__all__ = ["use_gguf_tokenizer"]


def use_gguf_tokenizer(model: MutableMapping[str, Any] | None, data: MutableMapping[str, Any] | None) -> str | None:
    """Set ``data.tokenizer`` (and ``model.tokenizer``, which it is linked to) to the model's GGUF file when the data
    names the embedded tokenizer; returns the line that says so, or None when nothing changed.

    Raises:
        ValueError: the GGUF file is on the hub, where no local path names it: ``data.tokenizer`` must be given.
    """
    if model is None or data is None or data.get("tokenizer") != EMBEDDED:
        return None
    init_kwargs = model.get("model_init_kwargs") or {}
    gguf = find_gguf(model.get("model"), init_kwargs.get("gguf_file"))
    if gguf is None:
        return None
    if not gguf.local:
        raise ValueError(
            f"model {model.get('model')!r} is the GGUF file {gguf.name!r} on the hub, and data.tokenizer is the "
            "embedded tokenizer, made for random-weight presets. Give data.tokenizer: the model's tokenizer (its hub "
            "id, or the .gguf file once downloaded)."
        )
    data["tokenizer"] = gguf.path
    if "tokenizer" in model:
        model["tokenizer"] = gguf.path
    return f"data.tokenizer: the tokenizer of the GGUF model {gguf.path} (in place of the embedded {EMBEDDED!r})."
