"""Structured output: grammars as token masks, whatever the logits; compile errors; the offline API."""

from __future__ import annotations

import json
import pickle
import re

import jsonschema
import pytest
import torch

from pluginfer import LLM, SamplingParams
from pluginfer.engine.sampler import Sampler, apply_grammar_masks
from pluginfer.engine.sequence import Sequence
from pluginfer.engine.structured import (
    GrammarCompiler,
    StructuredOutputError,
    StructuredOutputsParams,
    fill_token_bitmask,
)

# Bounded, so that any logits finish it within a few hundred tokens.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
        "manager": {"anyOf": [{"type": "null"}, {"type": "object", "properties": {"id": {"type": "integer",
                    "minimum": 1, "maximum": 99}}, "required": ["id"], "additionalProperties": False}]},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "tags", "manager", "active"],
    "additionalProperties": False,
}
EOS = 1  # the tiny tokenizer's </s>
PADDED_VOCAB = 2048  # the tokenizer has 2000 entries; models pad their embedding


@pytest.fixture(scope="module")
def compiler(tiny_tokenizer_dir) -> GrammarCompiler:
    from transformers import AutoTokenizer

    return GrammarCompiler(AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir)), PADDED_VOCAB, {EOS})


def constrained_run(compiler: GrammarCompiler, params: StructuredOutputsParams, seed: int, scale: float,
                    batch: int = 4, max_steps: int = 400) -> list[str]:
    """Sample ``batch`` sequences from random logits (a new draw every step) through the Sampler,
    advancing each grammar as the engine does; the decoded outputs."""
    generator = torch.Generator().manual_seed(seed)
    seqs = [Sequence("r", [5], SamplingParams(temperature=1.0, seed=seed, structured_outputs=params), index=i)
            for i in range(batch)]
    for s in seqs:
        s.grammar = compiler.matcher(params)
    sampler = Sampler(PADDED_VOCAB, {EOS})
    live = list(seqs)
    for _ in range(max_steps):
        logits = torch.randn(len(live), PADDED_VOCAB, generator=generator) * scale
        for s, token in zip(live, sampler(logits, live).token_ids):
            assert token < 2000, "a padding column was sampled"
            s.output_token_ids.append(token)
            assert s.grammar.consume_token(token), s.grammar.get_error()
        live = [s for s in live if not s.grammar.is_stopped() and s.output_token_ids[-1] != EOS]
        if not live:
            break
    assert not live, "a bounded grammar did not finish"
    tokenizer = compiler.hf_tokenizer
    return [tokenizer.decode([t for t in s.output_token_ids if t != EOS]) for s in seqs]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("scale", [1.0, 8.0])  # near-uniform, and peaked logits
def test_json_schema_output_validates_whatever_the_logits(compiler, seed, scale):
    for text in constrained_run(compiler, StructuredOutputsParams(json=PERSON), seed, scale):
        jsonschema.validate(json.loads(text), PERSON)


@pytest.mark.parametrize("seed", range(3))
def test_regex_choice_and_grammar_outputs_match_whatever_the_logits(compiler, seed):
    for text in constrained_run(compiler, StructuredOutputsParams(regex=r"[a-z]{2,5}-[0-9]{1,3}"), seed, 4.0):
        assert re.fullmatch(r"[a-z]{2,5}-[0-9]{1,3}", text), text
    for text in constrained_run(compiler, StructuredOutputsParams(choice=["yes", "no", "maybe so"]), seed, 4.0):
        assert text in ("yes", "no", "maybe so")
    lark = 'start: "(" item ("," item)~0..3 ")"\nitem: /[0-9]/ | "x"'
    for text in constrained_run(compiler, StructuredOutputsParams(grammar=lark), seed, 4.0):
        assert re.fullmatch(r"\((?:[0-9x])(?:,[0-9x]){0,3}\)", text), text
    gbnf = 'root ::= "a" [bc]{1,4} "d"'
    for text in constrained_run(compiler, StructuredOutputsParams(grammar=gbnf), seed, 4.0):
        assert re.fullmatch(r"a[bc]{1,4}d", text), text


def test_json_whitespace_is_bounded_or_off(compiler):
    compact = StructuredOutputsParams(json=PERSON, disable_any_whitespace=True)
    for text in constrained_run(compiler, compact, 0, 1.0):
        assert json.dumps(json.loads(text), separators=(",", ":"), ensure_ascii=False) == text
    for text in constrained_run(compiler, StructuredOutputsParams(json=PERSON), 0, 1.0):
        assert not re.search(r"\s{17}", re.sub(r'"(?:[^"\\]|\\.)*"', '""', text))  # outside strings


def test_masks_touch_only_constrained_rows(compiler):
    params = StructuredOutputsParams(choice=["yes", "no"])
    free, bound = Sequence("a", [5], SamplingParams()), Sequence("b", [5], SamplingParams(structured_outputs=params))
    bound.grammar = compiler.matcher(params)
    logits = torch.randn(2, PADDED_VOCAB)
    masked = apply_grammar_masks(logits, [free, bound])
    assert torch.equal(masked[0], logits[0])
    allowed = torch.nonzero(masked[1].isfinite()).flatten().tolist()
    assert sorted(compiler.hf_tokenizer.decode([t]) for t in allowed) == ["n", "y"]
    assert fill_token_bitmask([bound.grammar], PADDED_VOCAB)[0, 2000:].sum() == 0  # padding never allowed


def test_compiled_once_per_grammar_and_copied_per_sequence(compiler):
    params = StructuredOutputsParams(json={"type": "object", "properties": {"k": {"type": "integer"}}})
    first = compiler.compile(params)
    again = compiler.compile(StructuredOutputsParams(json={"properties": {"k": {"type": "integer"}}, "type": "object"}))
    assert first is again  # the cache key is the canonical JSON
    one, two = compiler.matcher(params), compiler.matcher(params)
    assert one is not two and one is not first
    assert one.consume_token(compiler.hf_tokenizer.encode("{")[0]) and two.is_accepting() is False


@pytest.mark.parametrize(("params", "says"), [
    (dict(json={"type": "strin"}), "strin"),
    (dict(json="{not json"), "not valid JSON"),
    (dict(json=[1]), "must be an object"),
    (dict(regex="a(b"), "unclosed group"),
    (dict(grammar="start: undefined_rule"), "undefined_rule"),
])
def test_grammars_that_do_not_compile_say_why(compiler, params, says):
    with pytest.raises(StructuredOutputError, match=re.escape(says)):
        compiler.compile(StructuredOutputsParams(**params))


@pytest.mark.parametrize("params", [dict(), dict(regex="a", choice=["a"]), dict(choice=[]), dict(choice=[1])])
def test_exactly_one_grammar_is_given(params):
    with pytest.raises(StructuredOutputError):
        StructuredOutputsParams(**params)


def test_sampling_params_with_a_grammar_pickle():
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json=PERSON), n=2)
    assert pickle.loads(pickle.dumps(params)) == params
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={"json": PERSON})


def test_offline_api_constrains_each_sequence_and_leaves_the_batch_alone(tiny_llama_checkpoint):
    small = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                              "ok": {"type": "boolean"}},
             "required": ["name", "ok"], "additionalProperties": False}
    with LLM(model=str(tiny_llama_checkpoint[0]), dtype="float32", num_blocks=128, block_size=8) as llm:
        free = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        alone = llm.generate(["the cat"], free)[0].outputs[0].token_ids
        json_params = SamplingParams(temperature=0.8, seed=3, n=3, max_tokens=200,
                                     structured_outputs=StructuredOutputsParams(json=small))
        choice_params = SamplingParams(temperature=0.0, max_tokens=20,
                                       structured_outputs=StructuredOutputsParams(choice=["red", "green"]))
        as_json, as_choice, unconstrained = llm.generate(["hello world", "pick", "the cat"],
                                                         [json_params, choice_params, free])
        for choice in as_json.outputs:
            assert choice.finish_reason == "stop"
            jsonschema.validate(json.loads(choice.text), small)
        assert as_choice.outputs[0].text in ("red", "green") and as_choice.outputs[0].finish_reason == "stop"
        assert unconstrained.outputs[0].token_ids == alone  # the masks stay on their own rows
