"""A checkpoint directory's ``tokenizer.json`` loaded by the ``tokenizers`` library, without transformers.

Importing transformers' tokenizer classes costs more than torch's import. ``build_hf_tokenizer`` loads the file
alone only where transformers 5 would use it unchanged (no special tokens to add, no post-processor rewrite,
no decode clean-up, no pre-tokenizer patch, no unknown ``tokenizer_config.json`` key); anywhere else it returns
None and transformers loads it (``text/tokenizer.py``). tests/text/test_hf_tokenizer.py holds it to transformers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pluginfer.formats.gguf.tokenizer import GGUFTokenizer

NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_PLAIN_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
# tokenizer_config.json keys that do not change the tokenizer, its special tokens or its template (for this use)
_KNOWN_KEYS = {"backend", "tokenizer_class", "clean_up_tokenization_spaces", "extra_special_tokens",
               "model_max_length", "chat_template", "padding_side", "truncation_side", "model_input_names",
               "is_local", "added_tokens_decoder", *NAMED_SPECIAL_TOKENS}
_ADDED_TOKEN_FIELDS = ("content", "special", "lstrip", "rstrip", "single_word", "normalized")
# past it transformers may patch the pre-tokenizer (its Mistral regex fix)
_MAX_PLAIN_VOCAB = 100_000


class HFTokenizer(GGUFTokenizer):
    """GGUFTokenizer's interface over a checkpoint's ``tokenizer.json`` and the special tokens of its
    ``tokenizer_config.json`` (all seven named ones, and the extra ones, as transformers 5 lists them)."""

    def __init__(self, backend: Any, special_tokens: dict[str, str | None], extra_special_tokens: list[str],
                 chat_template: str | None) -> None:
        super().__init__(backend, special_tokens, chat_template)
        self.sep_token, self.cls_token = special_tokens.get("sep_token"), special_tokens.get("cls_token")
        self.mask_token = special_tokens.get("mask_token")
        self.extra_special_tokens = list(extra_special_tokens)

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """The named special tokens that are set (the chat template reads them as variables)."""
        return {name: getattr(self, name) for name in NAMED_SPECIAL_TOKENS if getattr(self, name) is not None}

    @property
    def all_special_tokens(self) -> list[str]:
        return list(dict.fromkeys([*self.special_tokens_map.values(), *self.extra_special_tokens]))


def build_hf_tokenizer(directory: str | Path) -> HFTokenizer | None:
    """The tokenizer of a checkpoint directory, or None where transformers must build it (the module's
    docstring says when)."""
    directory = Path(directory)
    file, config_file = directory / "tokenizer.json", directory / "tokenizer_config.json"
    if not (file.is_file() and config_file.is_file()) or \
            any((directory / name).exists() for name in ("special_tokens_map.json", "added_tokens.json")):
        return None  # the older layouts: transformers merges those files in
    config = json.loads(config_file.read_text(encoding="utf-8"))
    if not isinstance(config, dict) or config.get("tokenizer_class") not in _PLAIN_CLASSES:
        return None
    if set(config) - _KNOWN_KEYS:
        return None
    if config.get("clean_up_tokenization_spaces", False) is not False:
        return None
    template = _chat_template(directory, config)
    if template is False:
        return None
    special = {name: _content(config.get(name)) for name in NAMED_SPECIAL_TOKENS}
    given_extra = config.get("extra_special_tokens") or []
    if not isinstance(given_extra, list):
        # named extra tokens (a dict): transformers sets attributes for them
        return None
    extra = [_content(token) for token in given_extra]
    unread = [name for name in NAMED_SPECIAL_TOKENS if config.get(name) is not None and special[name] is None]
    if None in extra or unread:
        return None  # a form of special token this module does not read
    from tokenizers import Tokenizer

    backend = Tokenizer.from_file(str(file))
    if backend.post_processor is None or backend.padding is not None or backend.truncation is not None:
        return None
    if backend.get_vocab_size(with_added_tokens=False) > _MAX_PLAIN_VOCAB:
        return None
    decoder = backend.get_added_tokens_decoder()
    for index, given in (config.get("added_tokens_decoder") or {}).items():
        token = decoder.get(int(index)) if str(index).isdigit() else None
        if token is None or not isinstance(given, dict) or any(
                given.get(field, getattr(token, field)) != getattr(token, field) for field in _ADDED_TOKEN_FIELDS):
            return None  # transformers would add it, or change it
    added = {token.content: token for token in decoder.values()}
    wanted = [token for token in special.values() if token is not None] + extra
    if any(token not in added or not added[token].special for token in wanted):
        return None  # transformers would add it
    return HFTokenizer(backend, special, extra, template)


def _content(token: Any) -> str | None:
    """A special token as tokenizer_config.json gives it: a string, or an AddedToken's dict (its content)."""
    if token is None or isinstance(token, str):
        return token
    if isinstance(token, dict) and isinstance(token.get("content"), str):
        return token["content"]
    return None


def _chat_template(directory: Path, config: dict) -> str | None | bool:
    """The one chat template (``chat_template.jinja``, else the config's string); False for the forms this
    module leaves to transformers (named templates, ``chat_template.json``, ``additional_chat_templates``)."""
    if any((directory / name).exists() for name in ("chat_template.json", "additional_chat_templates")):
        return False
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = config.get("chat_template")
    return template if template is None or isinstance(template, str) else False
