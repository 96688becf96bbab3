"""A GGUF file's tokenizer built by the ``tokenizers`` library from the file's metadata, without transformers.

transformers builds the same Rust tokenizer from the same ``tokenizer.ggml.*`` keys
(``integrations/gguf/gguf_tokenizer_mapping.py``) and wraps it in classes whose import alone takes ~0.5 s
and whose build of a 49k-token vocabulary takes ~2 s. ``build_gguf_tokenizer`` builds the byte-level BPE
(``tokenizer.ggml.model`` "gpt2": GPT-2, Llama 3, Qwen2, SmolLM, ...) and the SentencePiece BPE ("llama":
Llama 2, Mistral, Phi-3, Gemma 1-3, ...) vocabularies as transformers 5 does: the same model, pre-tokenizer
(with the split rule of the file's ``tokenizer.ggml.pre``), decoder, post-processor and added tokens (control tokens
special, user-defined tokens plain, the named special tokens special); tests/formats/test_gguf_tokenizer.py
holds it to transformers' tokenizer on the same files. Other kinds (unigram) return None:
``text/tokenizer.py`` builds those through transformers.

One difference, on purpose: transformers adds its wrapping class's default special tokens (GPT2Tokenizer's
``<|endoftext|>``, LlamaTokenizer's ``<s>``, ``</s>``, ``<unk>``) to a vocabulary that lacks them, as ids past
the model's vocabulary; they are not added here.

``GGUFTokenizer`` has what the engine and the server use of a transformers tokenizer: ``encode``,
``decode``, ``len()``, ``get_vocab``, the special tokens and their ids, ``added_tokens_decoder``,
``backend_tokenizer``, ``chat_template`` and ``apply_chat_template`` (``text/chat_template.py``); and, for
callers of ``LLM.get_tokenizer()``, ``batch_decode``, ``tokenize``, ``convert_tokens_to_ids``,
``convert_ids_to_tokens`` and ``add_tokens`` (tests/text/test_hf_tokenizer.py holds them to transformers).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from pluginfer.text.chat_template import render_chat_template

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp's token types
_SPECIAL_TOKENS = (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                   ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id"))
_GEMMA = ("gemma", "gemma2", "gemma3")  # SentencePiece as GemmaTokenizer builds it

# How text is split before byte-level BPE, by ``tokenizer.ggml.pre`` (as transformers' GGUF_PRE_TOKENIZER_SPLITS).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                 r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                 r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
_QWEN35_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"""
                 r"""| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "jina-v5-nano", "dbrx", "smaug-bpe"), _LLAMA3_SPLIT),
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O_SPLIT),
}


class GGUFTokenizer:
    """A Rust ``tokenizers.Tokenizer`` with the special tokens and chat template of its GGUF file."""

    def __init__(self, backend: Any, special_tokens: dict[str, str | None], chat_template: str | None) -> None:
        self.backend_tokenizer = backend
        self.bos_token, self.eos_token = special_tokens.get("bos_token"), special_tokens.get("eos_token")
        self.unk_token, self.pad_token = special_tokens.get("unk_token"), special_tokens.get("pad_token")
        self.mask_token = special_tokens.get("mask_token")
        self.chat_template = chat_template
        self.fim_token_ids: dict[str, Any] | None = None  # a GGUF file's fill-in-the-middle ids (text/fim.py)

    # -- text and ids ---------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode takes a str, not {type(text).__name__}")
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: int | list[int], skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool | None = None) -> str:
        """``clean_up_tokenization_spaces`` is accepted and, as transformers does for a BPE model, not applied."""
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        return self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def batch_decode(self, sequences: list[list[int]], skip_special_tokens: bool = False) -> list[str]:
        return [self.decode(ids, skip_special_tokens=skip_special_tokens) for ids in sequences]

    def tokenize(self, text: str, add_special_tokens: bool = False) -> list[str]:
        """The token strings of ``text`` (as transformers' ``tokenize``: without special tokens by default)."""
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).tokens

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | None | list[int | None]:
        """A token's id, the unknown token's for one not in the vocabulary (None without one), as transformers."""
        if isinstance(tokens, str):
            index = self.backend_tokenizer.token_to_id(tokens)
            return self.unk_token_id if index is None else index
        return [self.convert_tokens_to_ids(token) for token in tokens]

    def convert_ids_to_tokens(self, ids: int | list[int], skip_special_tokens: bool = False) -> str | None | list:
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        special = set(self.all_special_ids) if skip_special_tokens else set()
        return [self.backend_tokenizer.id_to_token(index) for index in ids if index not in special]

    def add_tokens(self, tokens: str | Any | list, special_tokens: bool = False) -> int:
        """Add tokens to the vocabulary (strings or ``tokenizers.AddedToken``); how many were new."""
        tokens = tokens if isinstance(tokens, list) else [tokens]
        add = self.backend_tokenizer.add_special_tokens if special_tokens else self.backend_tokenizer.add_tokens
        return add(tokens)

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    @property
    def added_tokens_decoder(self) -> dict[int, Any]:
        return self.backend_tokenizer.get_added_tokens_decoder()

    # -- special tokens -------------------------------------------------------------------------

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """The named special tokens the file gives (the chat template reads them as variables)."""
        names = ("bos_token", "eos_token", "unk_token", "pad_token", "mask_token")
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}

    @property
    def all_special_tokens(self) -> list[str]:
        return list(dict.fromkeys(self.special_tokens_map.values()))

    @property
    def all_special_ids(self) -> list[int]:
        return [self.backend_tokenizer.token_to_id(token) for token in self.all_special_tokens]

    @property
    def bos_token_id(self) -> int | None:
        return None if self.bos_token is None else self.backend_tokenizer.token_to_id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return None if self.eos_token is None else self.backend_tokenizer.token_to_id(self.eos_token)

    @property
    def unk_token_id(self) -> int | None:
        return None if self.unk_token is None else self.backend_tokenizer.token_to_id(self.unk_token)

    @property
    def pad_token_id(self) -> int | None:
        return None if self.pad_token is None else self.backend_tokenizer.token_to_id(self.pad_token)

    # -- chat -----------------------------------------------------------------------------------

    def apply_chat_template(self, conversation: list[dict], tools: list[dict] | None = None,
                            documents: list[dict] | None = None, chat_template: str | None = None,
                            add_generation_prompt: bool = False, continue_final_message: bool | str = False,
                            tokenize: bool = True, **kwargs: Any) -> str | list[int]:
        """As transformers' ``apply_chat_template`` for one conversation: the text, or its ids (``tokenize``)."""
        template = chat_template or self.chat_template
        if not template:
            raise ValueError("this tokenizer has no chat_template")
        text = render_chat_template(template, conversation, self.special_tokens_map, add_generation_prompt,
                                    tools=tools, documents=documents, continue_final_message=continue_final_message,
                                    **kwargs)
        return self.encode(text, add_special_tokens=False) if tokenize else text


def build_gguf_tokenizer(gguf: Any) -> GGUFTokenizer | None:
    """The tokenizer of an open ``formats.gguf.reader.GGUFFile``; None for a kind transformers must build."""
    kind = gguf.get("tokenizer.ggml.model")
    tokens = gguf.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise ValueError("the GGUF file has no tokenizer (no tokenizer.ggml.tokens)")
    architecture = gguf.get("general.architecture")
    merges = gguf.get("tokenizer.ggml.merges")
    if kind == "gpt2" and merges is not None:
        backend, vocab = _byte_level(tokens, merges)
        defaults = ["<|endoftext|>"]  # GPT2Tokenizer's special tokens
    elif kind == "llama":
        scores = gguf.get("tokenizer.ggml.scores")
        if merges is None and scores is None:
            return None
        if architecture in _GEMMA:
            backend, vocab = _gemma(tokens, merges)
            defaults = ["<bos>", "<eos>", "<unk>", "<pad>", "<mask>"]  # GemmaTokenizer's
        else:
            backend, vocab = _sentencepiece(tokens, merges, scores)
            defaults = ["<s>", "</s>", "<unk>"]  # LlamaTokenizer's
            if architecture == "phi3":
                _phi3_prefix_space(backend)
    else:
        return None
    from tokenizers import AddedToken, Regex, pre_tokenizers

    token_types = gguf.get("tokenizer.ggml.token_type") or []
    special = {name: tokens[gguf.get(f"tokenizer.ggml.{key}")] if gguf.get(f"tokenizer.ggml.{key}") is not None
               else None for name, key in _SPECIAL_TOKENS}
    # Added tokens in transformers' order: its inner class's defaults, the file's control tokens (special),
    # its user-defined tokens (plain), then the named special tokens not added yet.
    added: set[str] = set()

    def add(contents: list[str], is_special: bool) -> None:
        fresh = [token for token in contents if token not in added]
        if not fresh:  # each call rebuilds the added tokens' matcher (~30 ms with 47k of them)
            return
        added.update(fresh)
        tokens_to_add = [AddedToken(token, normalized=False, special=is_special) for token in fresh]
        if is_special:
            backend.add_special_tokens(tokens_to_add)
        else:
            backend.add_tokens(tokens_to_add)

    if architecture in _GEMMA and "<mask>" in vocab:  # GemmaTokenizer names its mask token
        special["mask_token"] = "<mask>"
    add([token for token in defaults if token in vocab], True)  # (the module docstring: not past the vocabulary)
    spelled = set(_bytes_to_unicode().values()) if kind == "gpt2" else None
    add([token for token, token_type in zip(tokens, token_types)
         if token_type == _CONTROL and (spelled is None or set(token) <= spelled)], True)
    # Every token added so far is in ``vocab`` (the model's), so this is transformers' test against the vocabulary
    # with its added tokens.
    add([token for token, token_type in zip(tokens, token_types) if token_type == _USER_DEFINED and token in vocab],
        False)
    add([token for token in special.values() if token is not None], True)
    split = PRE_TOKENIZER_SPLITS.get(gguf.get("tokenizer.ggml.pre"))
    if split is not None:
        backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                         pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                  use_regex=False)])
    add_bos = gguf.get("tokenizer.ggml.add_bos_token", True if kind == "llama" else False)
    add_eos = gguf.get("tokenizer.ggml.add_eos_token", False)
    backend.post_processor = _post_processor(backend, special["bos_token"] if add_bos else None,
                                             special["eos_token"] if add_eos else None)
    tokenizer = GGUFTokenizer(backend, special, gguf.get("tokenizer.chat_template"))
    tokenizer.fim_token_ids = fim_token_ids(gguf)
    return tokenizer


def fim_token_ids(gguf: Any) -> dict[str, Any] | None:
    """The fill-in-the-middle ids the file's metadata names (``text/fim.py`` reads them), or None."""
    def first(*names: str) -> int | None:
        return next((gguf.get(f"tokenizer.ggml.{name}") for name in names
                     if gguf.get(f"tokenizer.ggml.{name}") is not None), None)

    ids = {"prefix": first("fim_pre_token_id", "prefix_token_id"),
           "suffix": first("fim_suf_token_id", "suffix_token_id"),
           "middle": first("fim_mid_token_id", "middle_token_id")}
    if None in ids.values():
        return None
    stops = [first(name) for name in ("fim_pad_token_id", "fim_rep_token_id", "fim_sep_token_id", "eot_token_id")]
    return {**ids, "stops": [index for index in stops if index is not None]}


def _byte_level(tokens: list[str], merges: list[str]) -> tuple[Any, dict[str, int]]:
    """Byte-level BPE (GPT2Tokenizer's): tokens not spelled in the byte alphabet are respelled."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    if set("".join(tokens)) <= alphabet:  # every token spelled in the byte alphabet (one set, not one a token)
        vocab = dict(zip(tokens, range(len(tokens))))
    else:
        vocab = {token if set(token) <= alphabet else "".join(spelling[byte] for byte in token.encode("utf-8")):
                 index for index, token in enumerate(tokens)}
    backend = Tokenizer(BPE(vocab=vocab, merges=[tuple(merge.split(" ")) for merge in merges], dropout=None,
                            continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return backend, vocab


def _sentencepiece(tokens: list[str], merges: list[str] | None, scores: list[float] | None
                   ) -> tuple[Any, dict[str, int]]:
    """SentencePiece BPE with byte fallback (LlamaTokenizer's); merges from the file or from the scores."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    vocab = {token: index for index, token in enumerate(tokens)}
    if merges is not None:
        pairs = [tuple(merge.split(" ")) for merge in merges]
    else:
        pairs = _merges_from_scores(vocab, dict(zip(tokens, scores)))
    backend = Tokenizer(BPE(vocab=vocab, merges=pairs, fuse_unk=True, byte_fallback=True, dropout=None))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(content=" ", left=1)])
    return backend, vocab


def _gemma(tokens: list[str], merges: list[str] | None) -> tuple[Any, dict[str, int]]:
    """Gemma's SentencePiece BPE (GemmaTokenizer's): spaces normalized to "\u2581", no prefix space; its files
    spell whitespace-run tokens with real spaces (respelled here), and their merge order is the tokens' order in
    the file, not their scores (transformers' ``gemma_tokenizer``)."""
    from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE

    tokens = ["\u2581" * len(token) if " " in token and not token.strip() else token for token in tokens]
    vocab = {token: index for index, token in enumerate(tokens)}
    if merges is not None:
        pairs = [tuple(merge.split(" ")) for merge in merges]
    else:
        pairs = _merges_from_scores(vocab, {token: -index for index, token in enumerate(tokens)})
    backend = Tokenizer(BPE(vocab=vocab, merges=pairs, fuse_unk=True, unk_token="<unk>", dropout=None,
                            byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    backend.normalizer = normalizers.Replace(" ", "\u2581")
    return backend, vocab


def _phi3_prefix_space(backend: Any) -> None:
    """Phi-3's prefix space comes from a normalizer, not the pre-tokenizer: "  hi" is three "\u2581" then "hi"
    (transformers' ``phi3_tokenizer``, rebuilt from Phi-3's tokenizer.json, which a GGUF file does not carry)."""
    from tokenizers import normalizers

    backend.normalizer = normalizers.Sequence([normalizers.Prepend(prepend="\u2581"),
                                               normalizers.Replace(pattern=" ", content="\u2581")])
    backend.pre_tokenizer = None


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """Every split of a token into two tokens, best score first (transformers' ``generate_merges``)."""
    merges = []
    for merge, score in scores.items():
        local = [(merge[:i], merge[i:], score) for i in range(1, len(merge)) if merge[:i] in vocab and merge[i:] in vocab]
        merges.extend(sorted(local, key=lambda pair: (vocab[pair[0]], vocab[pair[1]])))
    merges.sort(key=lambda pair: (pair[2], len(pair[0]), len(pair[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _post_processor(backend: Any, bos: str | None, eos: str | None) -> Any:
    """BOS/EOS around each sequence when the file says to add them (transformers' ``update_post_processor``)."""
    from tokenizers import processors

    single = f"{bos + ':0 ' if bos else ''}$A:0{' ' + eos + ':0' if eos else ''}"
    pair = f"{single}{' ' + bos + ':1' if bos else ''} $B:1{' ' + eos + ':1' if eos else ''}"
    special = [(token, backend.token_to_id(token)) for token in (bos, eos) if token]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


@lru_cache(maxsize=1)
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    characters = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            characters.append(256 + extra)
            extra += 1
    return dict(zip(printable, (chr(c) for c in characters)))
