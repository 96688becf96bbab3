"""text/tokenizer.py: a GGUF file's tokenizer that transformers builds (a kind formats/gguf/tokenizer.py does not
build) is built once and then read from $PLUGINFER_CACHE; the cache works the same whatever the file's kind,
so these tests build the byte-level tokenizer of a converted checkpoint through transformers."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest

from pluginfer.cli.convert import convert_to_gguf
from pluginfer.formats.gguf.tokenizer import GGUFTokenizer
from pluginfer.text.tokenizer import (
    TokenizerBuild,
    gguf_tokenizer_cache_path,
    load_tokenizer,
    transformers_gguf_tokenizer,
)

TEXT = "The engine reads a file.\n\n  Twice, <|im_start|>user 42 times é"


@pytest.fixture
def gguf_file(tiny_llama_checkpoint: tuple[Path, object], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PLUGINFER_CACHE", str(tmp_path / "cache"))
    return convert_to_gguf(tiny_llama_checkpoint[0], tmp_path / "tiny.gguf", "q8_0", "f32")


def test_the_first_load_caches_the_tokenizer_the_next_reads_it(gguf_file: Path, tiny_tokenizer_dir: Path) -> None:
    entry = gguf_tokenizer_cache_path(gguf_file)
    assert entry.parent.parent == Path(os.environ["PLUGINFER_CACHE"]) and not entry.exists()
    native = load_tokenizer(gguf_file)  # built by formats/gguf/tokenizer.py: no cache entry
    assert isinstance(native, GGUFTokenizer) and not entry.exists()
    built = transformers_gguf_tokenizer(gguf_file)
    assert entry.is_file()
    cached = transformers_gguf_tokenizer(gguf_file)
    assert cached.encode(TEXT) == built.encode(TEXT) == load_tokenizer(tiny_tokenizer_dir).encode(TEXT) == \
        native.encode(TEXT)
    assert cached.chat_template == built.chat_template and cached.eos_token_id == built.eos_token_id
    # What is read is the entry: one holding another tokenizer is what the next load returns.
    other = load_tokenizer(tiny_tokenizer_dir)
    other.add_tokens(["<a_token_only_the_entry_has>"])
    entry.write_bytes(pickle.dumps(other))
    assert "<a_token_only_the_entry_has>" in transformers_gguf_tokenizer(gguf_file).get_vocab()
    assert "<a_token_only_the_entry_has>" not in built.get_vocab()


def test_a_broken_entry_is_rebuilt_and_replaced(gguf_file: Path) -> None:
    built = transformers_gguf_tokenizer(gguf_file)
    entry = gguf_tokenizer_cache_path(gguf_file)
    entry.write_bytes(b"not a pickle")
    assert transformers_gguf_tokenizer(gguf_file).encode(TEXT) == built.encode(TEXT)
    assert pickle.loads(entry.read_bytes()).encode(TEXT) == built.encode(TEXT)
    assert [p.name for p in entry.parent.iterdir()] == [entry.name]  # no partial file left behind


def test_a_rewritten_file_has_another_entry(gguf_file: Path) -> None:
    entry = gguf_tokenizer_cache_path(gguf_file)
    stat = gguf_file.stat()
    os.utime(gguf_file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert gguf_tokenizer_cache_path(gguf_file) != entry
    assert gguf_tokenizer_cache_path(gguf_file.parent / ".." / gguf_file.parent.name / gguf_file.name) == \
        gguf_tokenizer_cache_path(gguf_file)  # the same file by another path


def test_an_unwritable_cache_still_gives_the_tokenizer(gguf_file: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv("PLUGINFER_CACHE", str(blocker))  # a file where the cache directory should be
    assert transformers_gguf_tokenizer(gguf_file).encode(TEXT)
    assert not gguf_tokenizer_cache_path(gguf_file).exists()


def test_only_the_newest_entries_are_kept(gguf_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pluginfer.text import tokenizer

    monkeypatch.setattr(tokenizer, "MAX_CACHED_TOKENIZERS", 3)
    directory = gguf_tokenizer_cache_path(gguf_file).parent
    directory.mkdir(parents=True)
    for age in range(5):  # older entries of other files
        old = directory / f"old{age}.pickle"
        old.write_bytes(b"")
        os.utime(old, ns=(10**18 - age * 10**12, 10**18 - age * 10**12))
    transformers_gguf_tokenizer(gguf_file)
    assert sorted(p.name for p in directory.iterdir()) == sorted(
        [gguf_tokenizer_cache_path(gguf_file).name, "old0.pickle", "old1.pickle"])


def test_a_tokenizer_built_in_a_thread_is_the_one_load_tokenizer_builds(gguf_file: Path) -> None:
    assert TokenizerBuild.applies(gguf_file) and not TokenizerBuild.applies(gguf_file.parent)
    building = TokenizerBuild(gguf_file)
    built, loaded = building.result(), load_tokenizer(gguf_file)
    assert isinstance(built, GGUFTokenizer) and building.seconds > 0
    assert built.encode(TEXT) == loaded.encode(TEXT)
    assert built.backend_tokenizer.to_str() == loaded.backend_tokenizer.to_str()  # model, added tokens, pre- and post-processing
    assert built.special_tokens_map == loaded.special_tokens_map and built.chat_template == loaded.chat_template
    assert building.result() is built  # joined once, read again


def test_a_kind_transformers_builds_is_built_by_it_after_the_thread(tmp_path: Path) -> None:
    from tests.formats.test_gguf_tokenizer import write_gguf

    tokens = ["<unk>", "<s>", "</s>", "\u2581a", "\u2581b", "a", "b"]
    unigram = write_gguf(tmp_path / "t5.gguf", tokens, "t5", [2, 3, 3, 1, 1, 1, 1],
                         scores=[0.0, 0.0, 0.0, -1.0, -2.0, -3.0, -4.0])
    built = TokenizerBuild(unigram).result()
    assert not isinstance(built, GGUFTokenizer)
    assert built.encode("a b ab") == load_tokenizer(unigram).encode("a b ab")


def test_an_error_in_the_thread_is_load_tokenizers_error(gguf_file: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(gguf_file.read_bytes()[:4096])  # the header breaks in its vocabulary
    with pytest.raises(ValueError) as loaded:
        load_tokenizer(broken)
    building = TokenizerBuild(broken)
    with pytest.raises(ValueError) as built:
        building.result()
    assert str(built.value) == str(loaded.value)
    assert str(built.value).startswith(f"cannot load a tokenizer from {broken}: ValueError: ")
    assert "\n" not in str(built.value)


def test_a_received_tokenizer_is_taken_as_it_comes(gguf_file: Path) -> None:
    """``receive`` (the engine core process taking its server's tokenizer): its tokenizer, or None with no
    transformers fallback (the engine then loads one), or its error as load_tokenizer's one line."""
    built = load_tokenizer(gguf_file)
    taken = TokenizerBuild(gguf_file, receive=lambda: built)
    assert taken.result() is built and taken.received
    assert TokenizerBuild(gguf_file, receive=lambda: None).result() is None

    def broken() -> None:
        raise OSError("the server closed its end")

    with pytest.raises(ValueError, match=rf"^cannot load a tokenizer from {gguf_file}: OSError: the server closed"):
        TokenizerBuild(gguf_file, receive=broken).result()
