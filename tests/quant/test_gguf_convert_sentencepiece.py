"""``pluginfer convert`` of checkpoints whose tokenizer is a SentencePiece ``tokenizer.model`` (Gemma 1-3, Phi-3,
Llama 2 and Mistral's), against llama.cpp's converter: the committed fixtures were written by it from the same
seeded checkpoints and the same trained SentencePiece models (fixtures/make_gguf_fixtures.py), so our file's
vocabulary (pieces, scores, types, special ids, Gemma's missing space prefix) must be theirs, and our engine must
tokenize text from our file as from theirs."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest

from pluginfer.cli.convert import convert_to_gguf
from pluginfer.formats.gguf.reader import GGUFFile
from pluginfer.formats.gguf.tokenizer import build_gguf_tokenizer
from tests.quant.fixtures.make_gguf_fixtures import MODELS, SENTENCEPIECE, save_model

FIXTURES = Path(__file__).parent / "fixtures"
STEMS = ("llamacpp-gemma", "llamacpp-gemma3", "llamacpp-phi3")
TEXT = "The quick brown fox  jumps over\\n  the lazy dog: 12345, éàü 你好 <s> and </s>."


def tokenizer_fields(path: Path) -> dict[str, object]:
    reader = gguf.GGUFReader(path)
    return {name: field.contents() for name, field in reader.fields.items()
            if name.startswith("tokenizer.") and name != "tokenizer.chat_template"}


@pytest.mark.parametrize("stem", STEMS)
def test_the_vocabulary_is_llama_cpps(stem: str, tmp_path: Path, tiny_tokenizer_dir: Path) -> None:
    assert stem in SENTENCEPIECE
    arch, config, outtypes = MODELS[stem]
    save_model(stem, arch, config, tmp_path, tiny_tokenizer_dir)
    assert (tmp_path / "tokenizer.model").is_file()
    ours = convert_to_gguf(tmp_path, tmp_path / "ours.gguf", "q8_0", "q8_0")
    theirs = FIXTURES / f"{stem}-{outtypes[0]}.gguf"
    assert tokenizer_fields(ours) == tokenizer_fields(theirs)
    ours_tokenizer, theirs_tokenizer = (build_gguf_tokenizer(GGUFFile(path)) for path in (ours, theirs))
    assert ours_tokenizer.encode(TEXT) == theirs_tokenizer.encode(TEXT)


def test_a_sentencepiece_style_tokenizer_json_without_its_model_is_refused(tmp_path: Path,
                                                                           tiny_tokenizer_dir: Path) -> None:
    """A BPE tokenizer.json without a byte-level pre-tokenizer (a SentencePiece model converted by transformers)
    would be written as a byte-level one, tokenizing otherwise: refused, naming what convert writes."""
    import json

    from tests.checkpoints import save_hf_model

    save_hf_model("LlamaForCausalLM", dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=2), tmp_path, tiny_tokenizer_dir)
    state = json.loads((tmp_path / "tokenizer.json").read_text())
    state["pre_tokenizer"] = {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first", "split": False}
    (tmp_path / "tokenizer.json").write_text(json.dumps(state))
    with pytest.raises(ValueError, match="SentencePiece ones from a tokenizer.model beside the weights"):
        convert_to_gguf(tmp_path, tmp_path / "out.gguf", "f16", "f16")
