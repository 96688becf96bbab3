"""formats/gguf/tokenizer.py against transformers' tokenizer of the same GGUF file (the oracle): the same Rust
tokenizer (model, pre-tokenizer, decoder, post-processor, added tokens), the same ids and text, the same
special tokens and the same chat template rendering (text/chat_template.py)."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from pluginfer.demo.tokenizer import CHAT_TEMPLATE, CORPUS_PATH
from pluginfer.formats.gguf.reader import GGUFFile
from pluginfer.formats.gguf.tokenizer import GGUFTokenizer, build_gguf_tokenizer
from pluginfer.text.tokenizer import load_tokenizer
from tests.text.tokenizer_oracle import assert_same_ids_and_text

FIXTURES = Path(__file__).parents[1] / "quant" / "fixtures"
TEXTS = [
    "The engine reads a file.",  # ASCII
    "  leading spaces, trailing  \n\n\ttabs and\r\nnewlines ",
    "héllo wörld, ¿qué? naïve café",  # Latin-1 letters
    "日本語のテキスト 😀 👩‍👩‍👧 \u200b zero width",  # unknown characters: byte-level bytes, or byte fallback
    "12345 numbers 3.14159 and 1,000,000",
    "<|im_start|>user\nhi<|im_end|>\n<s>x</s> <unk>",  # control tokens in the text
    "<think>plan</think> <|im_start|><|im_start|>",  # a user-defined token
    "don't I'm we're they've you'll he'd ABC'S",
    "def f(x):\n    return x**2  # sq\n\tif a != b: {'k': [1, 2]}\n\n\n    ",  # code: indentation runs
    "   ",  # only spaces
    "",
]
TOOLS_TEMPLATE = (
    "{%- if tools %}{{- 'Tools: ' + tools | tojson + '\\n' }}{%- endif %}"
    "{%- if documents %}{%- for d in documents %}{{- '[doc ' + d.title + '] ' }}{%- endfor %}{%- endif %}"
    "{%- set ns = namespace(turns=0) %}"
    "{%- for message in messages %}{%- set ns.turns = ns.turns + 1 %}"
    "{%- if message.role == 'assistant' %}{% generation %}{{- 'A: ' + message.content }}{% endgeneration %}"
    "{%- if message.reasoning_content is defined %}{{- ' (r: ' + message.reasoning_content + ')' }}{%- endif %}"
    "{%- else %}{{- message.role[0] | upper + ': ' + message.content | trim }}{%- endif %}"
    "{%- if message.name is defined %}{{- ' name=' + message.name }}{%- endif %}{{- '\\n' }}"
    "{%- endfor %}{{- 'turns=' + ns.turns | string + ' ' + bos_token + eos_token }}"
    "{%- if add_generation_prompt %}{{- 'A:' }}{%- endif %}{%- if flavour is defined %}{{- flavour }}{%- endif %}"
)
CONVERSATIONS = [
    [{"role": "user", "content": "hi é 😀"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "  hello  "},
     {"role": "assistant", "content": "hey"}, {"role": "user", "content": "again", "name": None}],
]


# llama.cpp's converter's vocabularies: byte-level (pre-tokenizer "gpt-2", Qwen2's "qwen2"), SentencePiece with scores
# (Phi-3's normalizer; Gemma's respelling and merge order); those of the families transformers reads as GGUF.
LLAMA_CPP_FILES = ("llama-q8_0", "qwen2-q8_0", "stablelm-q8_0", "qwen3moe-q8_0", "phi3-q8_0", "gemma2-q8_0",
                   "gemma3-q8_0")

# tokenizer.ggml.pre values with their own split rule, and those of our families' real files that split as GPT-2
# (DeepSeek V2/V3, GLM-4, StableLM 2, Phi-2: transformers maps no rule for them either).
SPLIT_RULES = ("llama-bpe", "qwen2", "tekken", "gpt-4o")
GPT2_RULE = ("deepseek-llm", "deepseek-v3", "glm4", "stablelm2", "phi-2", "gpt-2")


def write_gguf(path: Path, tokens: list[str], kind: str, token_types: list[int], *, scores: list[float] | None = None,
               merges: list[str] | None = None, pre: str | None = None, chat_template: str = CHAT_TEMPLATE,
               add_bos: bool | None = None, add_eos: bool | None = None, unk: int | None = 0,
               token_ids: dict[str, int] | None = None) -> Path:
    """A llama GGUF with this tokenizer and a one-tensor body (tokenizers only read the metadata); ``token_ids``:
    more ``tokenizer.ggml.*`` ids (``fim_pre_token_id``...)."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(256)
    writer.add_embedding_length(64)
    writer.add_block_count(1)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model(kind)
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    if scores is not None:
        writer.add_token_scores(scores)
    if merges is not None:
        writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    if unk is not None:
        writer.add_unk_token_id(unk)
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    if add_eos is not None:
        writer.add_add_eos_token(add_eos)
    writer.add_chat_template(chat_template)
    for key, index in (token_ids or {}).items():
        writer.add_uint32(f"tokenizer.ggml.{key}", index)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 64), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def sentencepiece_vocabulary(size: int = 600) -> list[str]:
    """A SentencePiece-style BPE vocabulary (▁ for spaces, <0xNN> byte tokens) trained on the demo corpus."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    bytes_ = [f"<0x{byte:02X}>" for byte in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=size, special_tokens=["<unk>", "<s>", "</s>", *bytes_],
                                  show_progress=False)
    tokenizer.train_from_iterator(CORPUS_PATH.read_text(encoding="utf-8").splitlines(), trainer=trainer)
    return [token for token, _ in sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])]


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("gguf_tokenizers")
    files = {name: FIXTURES / f"llamacpp-{name}.gguf" for name in LLAMA_CPP_FILES}  # llama.cpp's converter's
    spm = sentencepiece_vocabulary() + ["<|im_start|>", "<|im_end|>", "<think>"]
    types = [2, 3, 3] + [6] * 256 + [1] * (len(spm) - 262) + [3, 3, 4]
    files["sentencepiece"] = write_gguf(out / "spm.gguf", spm, "llama", types,
                                        scores=[-float(i) for i in range(len(spm))])
    files["sentencepiece-bos-eos"] = write_gguf(out / "spm-eos.gguf", spm, "llama", types,
                                                scores=[-float(i) for i in range(len(spm))], add_bos=False,
                                                add_eos=True, unk=None, chat_template=TOOLS_TEMPLATE)
    # llama.cpp's byte-level vocabulary again, with other split rules, BOS added, a user-defined token.
    source = GGUFFile(files["llama-q8_0"])
    tokens, merges = source.get("tokenizer.ggml.tokens"), source.get("tokenizer.ggml.merges")
    types = list(source.get("tokenizer.ggml.token_type"))
    types[-1] = 4
    for pre in (*SPLIT_RULES, *GPT2_RULE):
        files[f"byte-level-{pre}"] = write_gguf(out / f"bpe-{pre}.gguf", tokens, "gpt2", types, merges=merges,
                                                pre=pre, add_bos=True, chat_template=TOOLS_TEMPLATE)
    # A token not spelled in the byte alphabet is respelled (the vocabulary's slow path).
    files["byte-level-respelled"] = write_gguf(out / "bpe-respelled.gguf", tokens + ["new\nline €"], "gpt2",
                                               types + [1], merges=merges, pre="llama-bpe", add_bos=True)
    return files


def transformers_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="module")
def pairs(gguf_files: dict[str, Path]) -> dict[str, tuple[GGUFTokenizer, object]]:
    return {name: (build_gguf_tokenizer(GGUFFile(path)), transformers_tokenizer(path))
            for name, path in gguf_files.items()}


def _without_endoftext_artifact(state: dict, vocab_size: int) -> dict:
    """transformers adds its wrapping class's default special tokens (<|endoftext|>; Gemma's <bos>, <eos>, <mask>)
    past a vocabulary that lacks them; we do not (module docstring)."""
    state["added_tokens"] = [token for token in state["added_tokens"] if token["id"] < vocab_size]
    return state


@pytest.mark.parametrize("name", [*LLAMA_CPP_FILES, "sentencepiece", "sentencepiece-bos-eos",
                                  *(f"byte-level-{pre}" for pre in (*SPLIT_RULES, *GPT2_RULE)),
                                  "byte-level-respelled"])
def test_the_tokenizer_is_transformers_tokenizer_of_the_file(pairs: dict, name: str) -> None:
    ours, theirs = pairs[name]
    assert isinstance(ours, GGUFTokenizer)
    assert json.loads(ours.backend_tokenizer.to_str()) == _without_endoftext_artifact(
        json.loads(theirs.backend_tokenizer.to_str()), len(ours))
    assert_same_ids_and_text(ours, theirs, TEXTS)
    assert ours.decode(5) == theirs.decode(5)
    every_id = list(range(len(ours)))
    assert ours.decode(every_id) == theirs.decode(every_id)
    in_vocab = ours.get_vocab()  # (transformers' defaults past the vocabulary left out, as above)
    assert ours.special_tokens_map == {name: token for name, token in theirs.special_tokens_map.items()
                                       if token in in_vocab}
    assert ours.all_special_tokens == [token for token in theirs.all_special_tokens if token in in_vocab]
    assert ours.all_special_ids == [i for i in theirs.all_special_ids if i < len(ours)]
    for attribute in ("bos_token", "eos_token", "unk_token", "pad_token", "bos_token_id", "eos_token_id",
                      "unk_token_id", "pad_token_id", "chat_template"):
        assert getattr(ours, attribute) == getattr(theirs, attribute), attribute
    theirs_vocab = {token: i for token, i in theirs.get_vocab().items() if i < len(ours)}  # less the artifacts
    assert ours.get_vocab() == theirs_vocab and len(ours) == len(theirs_vocab)
    assert {i: str(t) for i, t in ours.added_tokens_decoder.items()} == \
        {i: str(t) for i, t in theirs.added_tokens_decoder.items() if i < len(ours)}


def test_byte_fallback_and_the_prefix_space_of_sentencepiece(pairs: dict) -> None:
    ours, theirs = pairs["sentencepiece"]
    ids = ours.encode("日本 x", add_special_tokens=False)
    byte_ids = {ours.backend_tokenizer.token_to_id(f"<0x{b:02X}>") for b in "日本".encode()}
    assert byte_ids <= set(ids) and ids == theirs.encode("日本 x", add_special_tokens=False)
    assert ours.decode(ids) == "日本 x"
    assert ours.encode("x")[0] == ours.bos_token_id  # llama.cpp adds BOS to a SentencePiece vocabulary by default
    eos_ours, eos_theirs = pairs["sentencepiece-bos-eos"]
    assert eos_ours.encode("x")[-1] == eos_ours.eos_token_id and eos_ours.encode("x") == eos_theirs.encode("x")
    assert eos_ours.unk_token is None


@pytest.mark.parametrize("name", ["llama-q8_0", "byte-level-qwen2", "sentencepiece-bos-eos"])
@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_chat_templates_render_as_transformers_renders_them(pairs: dict, name: str, conversation: int,
                                                            add_generation_prompt: bool) -> None:
    ours, theirs = pairs[name]
    messages = CONVERSATIONS[conversation]
    for kwargs in ({}, {"tools": [{"type": "function", "function": {"name": "f", "description": "é <b>"}}]},
                   {"documents": [{"title": "t1", "text": "x"}], "flavour": "!"}):
        rendered = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False,
                                            **kwargs)
        assert rendered == theirs.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                      tokenize=False, **kwargs)
        assert ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **kwargs) == \
            ours.encode(rendered, add_special_tokens=False)


def test_chat_template_options_as_transformers(pairs: dict) -> None:
    ours, theirs = pairs["byte-level-gpt-4o"]
    continued = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure, "}]
    assert ours.apply_chat_template(continued, tokenize=False, continue_final_message=True) == \
        theirs.apply_chat_template(continued, tokenize=False, continue_final_message=True)
    reasoning = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok", "thinking": "hmm"}]
    assert ours.apply_chat_template(reasoning, tokenize=False) == theirs.apply_chat_template(reasoning, tokenize=False)
    other = "{{ messages | length }}{{ bos_token }}"
    assert ours.apply_chat_template(continued, chat_template=other, tokenize=False) == \
        theirs.apply_chat_template(continued, chat_template=other, tokenize=False) == "2" + ours.bos_token
    import jinja2

    for tokenizer in (ours, theirs):  # the template's own error, raised as transformers raises it
        with pytest.raises(jinja2.exceptions.TemplateError, match="role must be system, user or assistant"):
            tokenizer.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False,
                                          chat_template=CHAT_TEMPLATE)
        with pytest.raises(ValueError, match="continue_final_message and add_generation_prompt"):
            tokenizer.apply_chat_template(continued, tokenize=False, continue_final_message=True,
                                          add_generation_prompt=True)
        with pytest.raises(ValueError, match="empty conversation"):
            tokenizer.apply_chat_template([], tokenize=False)
        for unsafe in ("{{ messages.append(1) }}", "{% set ns = namespace(_x=1) %}"):  # the sandbox
            with pytest.raises(jinja2.exceptions.SecurityError):
                tokenizer.apply_chat_template(continued, tokenize=False, chat_template=unsafe)
    with pytest.raises(ValueError, match="sanitize_control_tokens is not supported"):
        ours.apply_chat_template(continued, tokenize=False, sanitize_control_tokens=True)


def test_it_pickles_and_load_tokenizer_returns_it(gguf_files: dict[str, Path], pairs: dict) -> None:
    ours, _ = pairs["qwen2-q8_0"]
    again = pickle.loads(pickle.dumps(ours))
    assert again.encode(TEXTS[5]) == ours.encode(TEXTS[5]) and again.chat_template == ours.chat_template
    loaded = load_tokenizer(gguf_files["qwen2-q8_0"])
    assert isinstance(loaded, GGUFTokenizer) and loaded.encode(TEXTS[3]) == ours.encode(TEXTS[3])


def test_structured_output_reads_it(pairs: dict) -> None:
    from pluginfer.engine.structured import GrammarCompiler, StructuredOutputsParams

    ours, _ = pairs["llama-q8_0"]
    compiler = GrammarCompiler(ours, len(ours), {ours.eos_token_id})
    assert compiler.compile(StructuredOutputsParams(choice=["yes", "no"])) is not None


def test_kinds_it_does_not_build_are_left_to_transformers(tmp_path: Path) -> None:
    tokens = ["<unk>", "<s>", "</s>", "\u2581a"]
    unigram = write_gguf(tmp_path / "t5.gguf", tokens, "t5", [2, 3, 3, 1], scores=[0.0, 0.0, 0.0, -1.0])
    assert build_gguf_tokenizer(GGUFFile(unigram)) is None
    no_vocabulary = tmp_path / "none.gguf"
    writer = gguf.GGUFWriter(str(no_vocabulary), "llama")
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="no tokenizer"):
        build_gguf_tokenizer(GGUFFile(no_vocabulary))


def test_loading_it_imports_neither_torch_nor_transformers(gguf_files: dict[str, Path]) -> None:
    """The point of it: a GGUF model's tokenizer without transformers' ~0.5 s import, and without torch (the file's
    metadata alone is read), so the API server builds it while the engine core loads."""
    code = ("import pickle, sys\n"
            "from pluginfer.text.tokenizer import load_tokenizer\n"
            f"tokenizer = pickle.loads(pickle.dumps(load_tokenizer({str(gguf_files['sentencepiece'])!r})))\n"
            "tokenizer.apply_chat_template([{'role': 'user', 'content': 'hi'}])\n"
            "print(sorted(m for m in ('torch', 'transformers', 'sentencepiece') if m in sys.modules))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
