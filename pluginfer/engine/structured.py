"""Structured output: grammars (JSON schema, regex, choice, Lark/GBNF) as token masks, via llguidance.

A request's :class:`StructuredOutputsParams` (plain data, picklable) is compiled once per distinct
grammar by :class:`GrammarCompiler`, which caches the compiled matcher; each sequence gets a
copy that advances with every token it accepts. The sampler asks :func:`fill_token_bitmask`
for one bitmask over the batch (one bit per vocabulary entry, computed in llguidance's thread
pool without the GIL) and masks the disallowed logits in one vectorised operation.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from pluginfer.engine.regex_ascii import ascii_patterns, ascii_regex

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

# Between JSON tokens at most this much whitespace: enough for pretty-printing, and a weak model
# cannot loop on whitespace until max_tokens (llguidance's default allows any amount).
JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,16}"
_KINDS = ("json", "regex", "choice", "grammar", "json_object")


class StructuredOutputError(ValueError):
    """A grammar that cannot be compiled (the message says why), or a tokenizer llguidance cannot read."""


@dataclass
class StructuredOutputsParams:
    """What the output must match: exactly one of ``json`` (a JSON schema, dict or string),
    ``regex``, ``choice`` (one of these strings), ``grammar`` (Lark or GBNF) or ``json_object``
    (any JSON object). Names follow vLLM's ``StructuredOutputsParams``. In ``regex`` and a schema's
    ``pattern``, ``\\d``, ``\\w`` and ``\\s`` are ASCII, as in ECMAScript (``regex_ascii.py``)."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    whitespace_pattern: str | None = None  # JSON only: the whitespace allowed between tokens
    disable_any_whitespace: bool = False  # JSON only: none at all

    def __post_init__(self) -> None:
        given = [kind for kind in _KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise StructuredOutputError(f"give exactly one of {', '.join(_KINDS)}; got {given or 'none'}")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) for c in self.choice)):
            raise StructuredOutputError("choice must be a non-empty list of strings")

    @property
    def kind(self) -> str:
        return next(kind for kind in _KINDS if getattr(self, kind) not in (None, False))

    def cache_key(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    def to_grammar(self) -> str:
        """llguidance's grammar text (not yet checked: compiling it says whether it is valid)."""
        from llguidance import LLMatcher, grammar_from

        if self.regex is not None:
            return LLMatcher.grammar_from_regex(ascii_regex(self.regex))
        if self.choice is not None:
            return grammar_from("choice", self.choice)  # type: ignore[arg-type]
        if self.grammar is not None:
            try:
                return grammar_from("grammar", self.grammar)
            except Exception as exc:  # GBNF that does not convert
                raise StructuredOutputError(f"invalid grammar: {exc}") from None
        schema: Any = {"type": "object"} if self.json_object else self.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise StructuredOutputError(f"the JSON schema is not valid JSON: {exc}") from None
        if not isinstance(schema, dict):
            raise StructuredOutputError(f"a JSON schema must be an object, got {type(schema).__name__}")
        options: dict[str, Any] = {"whitespace_pattern": self.whitespace_pattern or JSON_WHITESPACE}
        if self.disable_any_whitespace:
            options = {"whitespace_flexible": False}
        try:
            return LLMatcher.grammar_from_json_schema(ascii_patterns(schema), overrides=options)  # type: ignore[arg-type]
        except (ValueError, TypeError) as exc:
            raise StructuredOutputError(f"invalid JSON schema: {exc}") from None


class GrammarCompiler:
    """Compiles grammars for one tokenizer and vocabulary; thread-safe, cached per grammar.

    Compile in the request's own thread (``compile``) so the step loop only copies a cached
    matcher (``matcher``).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: set[int], cache_size: int = 256) -> None:
        self.hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.cache_size = cache_size
        self._lock = threading.Lock()
        self._ll_tokenizer: Any = None
        self._cache: OrderedDict[str, Any] = OrderedDict()

    def _tokenizer(self) -> Any:
        with self._lock:
            if self._ll_tokenizer is None:
                try:
                    self._ll_tokenizer = _ll_tokenizer(self.hf_tokenizer, self.vocab_size, self.eos_token_ids)
                except Exception as exc:
                    # a slow (Python) tokenizer, or a vocabulary llguidance rejects
                    raise StructuredOutputError(f"structured output needs a fast tokenizer llguidance can "
                                                f"read: {type(exc).__name__}: {exc}") from None
            return self._ll_tokenizer

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The pristine matcher of this grammar (from the cache, or compiled now)."""
        key = params.cache_key()
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        from llguidance import LLMatcher

        grammar = params.to_grammar()
        matcher = LLMatcher(self._tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise StructuredOutputError(f"cannot compile the {params.kind} grammar: {matcher.get_error()}")
        with self._lock:
            self._cache[key] = matcher
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return matcher

    def matcher(self, params: StructuredOutputsParams) -> Any:
        """A fresh matcher for one sequence."""
        return self.compile(params).deep_copy()

    def __len__(self) -> int:
        return len(self._cache)


def accept_token(matcher: Any, token_id: int) -> bool:
    """Advance ``matcher`` by a sampled token; True when the output is complete (no token may follow)."""
    if not matcher.consume_token(token_id):
        # Only allowed tokens are sampled, so this is a bug; end the sequence rather than the engine.
        logger.error("structured output: token %d rejected by the grammar: %s", token_id, matcher.get_error())
        return True
    return matcher.is_stopped()


_executor: Any = None


def fill_token_bitmask(matchers: list[Any], vocab_size: int, forbidden: bool = False) -> torch.Tensor:
    """[len(matchers), vocab_size] bool: the tokens each matcher allows next (``forbidden``: the others)."""
    global _executor
    import numpy as np
    import torch
    from llguidance import LLExecutor

    if _executor is None:
        _executor = LLExecutor()
    words = (vocab_size + 31) // 32
    bitmask = np.full((len(matchers), words), -1, dtype=np.int32)
    # llguidance writes each row in its own threads, without the GIL (its torch helper module would
    # import torch.compile, seconds at start-up, for this one call).
    _executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], bitmask.ctypes.data,
                                      words * 4, len(matchers))
    if forbidden:
        # on the words: 32 times fewer elements than on the unpacked mask
        np.invert(bitmask, out=bitmask)
    # Little-endian int32 words: bit j of word w is token 32 * w + j.
    bits = np.unpackbits(bitmask.view(np.uint8), axis=1, count=vocab_size, bitorder="little")
    return torch.from_numpy(bits.view(np.bool_))


def _ll_tokenizer(tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> Any:
    """llguidance's view of a fast tokenizer: its Rust tokenizer's JSON, as ``llguidance.hf.from_tokenizer``
    makes it, without importing transformers (a GGUF file's tokenizer is not a transformers object)."""
    from copy import copy

    from llguidance import LLTokenizer

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(f"{type(tokenizer).__name__} is not a fast tokenizer")
    backend = copy(backend)
    backend.no_padding()
    backend.no_truncation()
    return LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=eos_token_ids or tokenizer.eos_token_id)
