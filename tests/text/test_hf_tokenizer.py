"""text/hf_tokenizer.py: a checkpoint's tokenizer.json loaded without transformers, held to transformers'
AutoTokenizer on the same directory; every form it leaves to transformers returns None (and still loads)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pluginfer.text.hf_tokenizer import HFTokenizer, build_hf_tokenizer
from pluginfer.text.tokenizer import load_tokenizer, native_tokenizer
from tests.text.tokenizer_oracle import assert_same_ids_and_text

TEXTS = ["Hello world", "  two  spaces\n\nand a newline", "<s>hi</s><|im_start|>user<|im_end|>", "naïve café 😀 中文",
         "", "the end.</s>"]
CONVERSATION = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"}, {"role": "user", "content": "again"}]


def assert_same_tokenizer(ours: HFTokenizer, theirs: object) -> None:
    assert_same_ids_and_text(ours, theirs, TEXTS)
    assert ours.special_tokens_map == theirs.special_tokens_map
    assert ours.all_special_tokens == theirs.all_special_tokens
    assert ours.all_special_ids == theirs.all_special_ids
    for name in ("bos_token_id", "eos_token_id", "unk_token_id", "pad_token_id"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert len(ours) == len(theirs) and ours.get_vocab() == theirs.get_vocab()
    assert {i: (t.content, t.special) for i, t in ours.added_tokens_decoder.items()} == \
        {i: (t.content, t.special) for i, t in theirs.added_tokens_decoder.items()}
    assert ours.chat_template == theirs.chat_template
    for prompt in (True, False):
        assert ours.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=prompt) == \
            theirs.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=prompt)
    ids = [theirs.encode(text) for text in TEXTS]
    for skip in (True, False):
        assert ours.batch_decode(ids, skip_special_tokens=skip) == theirs.batch_decode(ids, skip_special_tokens=skip)
        assert ours.convert_ids_to_tokens(ids[2], skip_special_tokens=skip) == \
            theirs.convert_ids_to_tokens(ids[2], skip_special_tokens=skip)
    assert ours.convert_ids_to_tokens(ids[0][0]) == theirs.convert_ids_to_tokens(ids[0][0])
    for text in TEXTS:
        assert ours.tokenize(text) == theirs.tokenize(text), text
    tokens = ["<|im_end|>", "<s>", "not-a-token-at-all", ours.tokenize("Hello")[0]]
    assert ours.convert_tokens_to_ids(tokens) == theirs.convert_tokens_to_ids(tokens)
    assert ours.convert_tokens_to_ids("<|im_end|>") == theirs.convert_tokens_to_ids("<|im_end|>")


def edited(source: Path, out: Path, **changes: object) -> Path:
    """A copy of the tokenizer directory with tokenizer_config.json's keys changed (None removes one)."""
    shutil.copytree(source, out)
    config = json.loads((out / "tokenizer_config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def test_the_demo_tokenizer_loads_natively_and_equals_transformers(tiny_tokenizer_dir: Path) -> None:
    from transformers import AutoTokenizer

    ours = load_tokenizer(tiny_tokenizer_dir)
    assert isinstance(ours, HFTokenizer)
    assert_same_tokenizer(ours, AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir)))


def test_the_config_s_template_and_added_tokens_when_they_agree_with_the_file(tiny_tokenizer_dir: Path,
                                                                             tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    template = (tiny_tokenizer_dir / "chat_template.jinja").read_text()
    decoder = {str(i): {"content": t.content, "special": t.special, "lstrip": t.lstrip, "rstrip": t.rstrip,
                        "single_word": t.single_word, "normalized": t.normalized}
               for i, t in load_tokenizer(tiny_tokenizer_dir).added_tokens_decoder.items()}
    directory = edited(tiny_tokenizer_dir, tmp_path / "tok", chat_template=template + "{# config #}",
                       added_tokens_decoder=decoder, tokenizer_class="PreTrainedTokenizerFast")
    (directory / "chat_template.jinja").unlink()
    ours = build_hf_tokenizer(directory)
    assert ours is not None and ours.chat_template.endswith("{# config #}")
    assert_same_tokenizer(ours, AutoTokenizer.from_pretrained(str(directory)))


@pytest.mark.parametrize("case", ["class", "add_bos_token", "clean_up", "unknown_key", "missing_special",
                                  "added_token_flags", "special_tokens_map", "chat_template_json", "named_extra"])
def test_what_transformers_would_change_is_left_to_it(tiny_tokenizer_dir: Path, tmp_path: Path, case: str) -> None:
    changes = {"class": {"tokenizer_class": "LlamaTokenizer"}, "add_bos_token": {"add_bos_token": True},
               "clean_up": {"clean_up_tokenization_spaces": True}, "unknown_key": {"legacy": False},
               "missing_special": {"pad_token": "<pad>"},  # not in the file: transformers adds it
               "added_token_flags": {"added_tokens_decoder": {"0": {"content": "<s>", "special": True,
                                                                    "lstrip": True}}},
               "named_extra": {"extra_special_tokens": {"image_token": "<|im_start|>"}}}.get(case, {})
    directory = edited(tiny_tokenizer_dir, tmp_path / "tok", **changes)
    if case == "special_tokens_map":
        (directory / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<s>"}))
    if case == "chat_template_json":
        (directory / "chat_template.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    assert build_hf_tokenizer(directory) is None
    assert native_tokenizer(directory) is None


def test_tokens_added_afterwards_as_transformers_adds_them(tiny_tokenizer_dir: Path) -> None:
    from transformers import AutoTokenizer

    ours, theirs = load_tokenizer(tiny_tokenizer_dir), AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir))
    assert ours.add_tokens(["<new_one>", "<new_two>"]) == theirs.add_tokens(["<new_one>", "<new_two>"]) == 2
    assert ours.add_tokens("<new_one>") == theirs.add_tokens("<new_one>") == 0
    assert ours.add_tokens(["<new_special>"], special_tokens=True) == \
        theirs.add_tokens(["<new_special>"], special_tokens=True) == 1
    text = "a<new_one>b<new_special>"
    assert ours.encode(text) == theirs.encode(text) and len(ours) == len(theirs)
    assert ours.decode(ours.encode(text), skip_special_tokens=True) == \
        theirs.decode(theirs.encode(text), skip_special_tokens=True)


def test_a_directory_without_a_tokenizer_json_is_left_to_transformers(tmp_path: Path) -> None:
    assert build_hf_tokenizer(tmp_path) is None
    (tmp_path / "tokenizer_config.json").write_text("{}")
    assert build_hf_tokenizer(tmp_path) is None


def test_loading_it_imports_neither_transformers_nor_torch(tiny_tokenizer_dir: Path) -> None:
    """What `pluginfer serve`'s server and the engine load for a checkpoint directory. sys.modules, not a timing."""
    code = ("import sys\nfrom pluginfer.text.tokenizer import load_tokenizer\n"
            f"tokenizer = load_tokenizer({str(tiny_tokenizer_dir)!r})\n"
            "tokenizer.apply_chat_template([{'role': 'user', 'content': 'hi'}], tokenize=False)\n"
            "print(type(tokenizer).__name__, sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "HFTokenizer []"
