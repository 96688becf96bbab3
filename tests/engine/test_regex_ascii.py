r"""``\d``, ``\w``, ``\s`` and their negations are ASCII in a regex grammar and in a JSON schema's ``pattern``.

The oracle is Python's ``re`` with ``re.ASCII`` (``\d`` is ``[0-9]``, ``\w`` ``[a-zA-Z0-9_]``, ``\s``
``[ \t\n\r\f\v]``, as in ECMAScript and OpenAI's documented regex dialect); what is checked is llguidance's
compiled matcher, fed the tokens of each candidate.
"""

from __future__ import annotations

import json
import re

import pytest

from pluginfer.engine.regex_ascii import ascii_regex
from pluginfer.engine.structured import GrammarCompiler, StructuredOutputsParams

REGEXES = [r"\d+", r"\D+", r"\w+", r"\W+", r"a\sb", r"a\Sb", r"[\d_]+", r"[^\D]+", r"[^\W_]+", r"[\s\d]+",
           r"\\d", r"[\]\d]+", r"(?:\d|x)+", r"\d{2}-\w"]
CANDIDATES = ["123", "١٢٣", "٣", "12", "abc_9", "é", "Ωx", "a b", "a\u00a0b", "a\u2003b", "a\tb", "axb", "\\d",
              "]7", "x9", "--", "9 ", "2\u0663", "12-é", "12-z", "_", " "]


@pytest.fixture(scope="module")
def compiler(tiny_tokenizer_dir) -> GrammarCompiler:
    from transformers import AutoTokenizer

    return GrammarCompiler(AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir)), 2048, {1})


def accepts(compiler: GrammarCompiler, params: StructuredOutputsParams, text: str) -> bool:
    matcher = compiler.matcher(params)
    tokens = compiler.hf_tokenizer.encode(text, add_special_tokens=False)
    return matcher.try_consume_tokens(tokens) == len(tokens) and matcher.is_accepting()


@pytest.mark.parametrize("regex", REGEXES)
def test_regex_grammar_matches_ascii_classes(compiler, regex):
    for text in CANDIDATES:
        expected = re.fullmatch(regex, text, re.ASCII) is not None
        assert accepts(compiler, StructuredOutputsParams(regex=regex), text) == expected, (regex, text)


@pytest.mark.parametrize("regex", [r"^\d+$", r"^\w+$", r"^a\sb$", r"\d", r"^[^\W]+$", r"^\S+$"])
def test_json_schema_pattern_matches_ascii_classes(compiler, regex):
    """A pattern is a search unless anchored, as in ECMAScript (and Python's ``re.search``)."""
    params = StructuredOutputsParams(json={"type": "string", "pattern": regex})
    for text in CANDIDATES:
        expected = re.search(regex, text, re.ASCII) is not None
        assert accepts(compiler, params, json.dumps(text, ensure_ascii=False)) == expected, (regex, text)


def test_pattern_inside_nested_schemas_and_property_named_pattern(compiler):
    schema = {"type": "object", "required": ["pattern", "ids"], "additionalProperties": False,
              "properties": {"pattern": {"type": "string", "pattern": r"^\d$", "default": r"\d"},
                             "ids": {"type": "array", "maxItems": 1, "items": {"anyOf": [
                                 {"type": "string", "pattern": r"^\w$"}, {"type": "null"}]}}}}
    params = StructuredOutputsParams(json=schema)
    assert accepts(compiler, params, '{"pattern":"7","ids":["x"]}')
    assert not accepts(compiler, params, '{"pattern":"٣","ids":[]}')
    assert not accepts(compiler, params, '{"pattern":"7","ids":["é"]}')


def test_translation_leaves_other_syntax_alone():
    assert ascii_regex(r"\p{L}\x41\n\.[a-z]\\w") == r"\p{L}\x41\n\.[a-z]\\w"
    assert ascii_regex(r"[\D]") == r"[[^0-9]]"  # Rust's nested class: the union with the other members
