"""The offline API end to end: ``LLM(...).generate`` and ``.chat`` on a tiny random llama checkpoint."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from pluginfer import LLM, SamplingParams
from tests.checkpoints import hf_logits

PROMPTS = ["hello world", "the cat sat on the mat"]


def _greedy(max_tokens: int = 8, **kwargs: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def _make_llm(path: Path, **kwargs: object) -> LLM:
    return LLM(model=str(path), dtype="float32", num_blocks=64, block_size=8, enable_prefix_caching=True, **kwargs)


@pytest.fixture(scope="module")
def llm(tiny_llama_checkpoint) -> LLM:
    return _make_llm(tiny_llama_checkpoint[0])


@pytest.fixture(autouse=True)
def _engine_left_clean(request):
    """Every test leaves the shared engine with no request queued and every KV block free."""
    yield
    if "llm" in request.fixturenames:
        engine = request.getfixturevalue("llm").engine
        assert not engine.has_unfinished_requests()
        assert engine.block_manager.num_free_blocks == 64


def test_generate_takes_text_token_ids_and_a_single_prompt(llm):
    params = _greedy(6)
    by_text = llm.generate(PROMPTS, params)
    assert [o.prompt for o in by_text] == PROMPTS
    tokenizer = llm.get_tokenizer()
    for out in by_text:
        assert out.finished and out.error is None
        [choice] = out.outputs
        assert choice.index == 0 and choice.finish_reason == "length" and len(choice.token_ids) == 6
        assert choice.logprobs is None  # not asked for
        assert choice.text == tokenizer.decode(choice.token_ids)

    by_ids = llm.generate([o.prompt_token_ids for o in by_text], params)
    assert [o.prompt for o in by_ids] == [None, None]
    assert [o.outputs[0].token_ids for o in by_ids] == [o.outputs[0].token_ids for o in by_text]

    [single_text] = llm.generate(PROMPTS[1], params)
    [single_ids] = llm.generate(by_text[1].prompt_token_ids, params)
    assert single_text.outputs[0].text == single_ids.outputs[0].text == by_text[1].outputs[0].text


def test_logprobs_hold_the_sampled_token_and_the_top_alternatives(llm, tiny_llama_checkpoint):
    model = tiny_llama_checkpoint[1]
    [out] = llm.generate(PROMPTS[0], _greedy(5, logprobs=3))
    choice = out.outputs[0]
    assert len(choice.logprobs) == len(choice.token_ids) == 5
    assert all(type(t) is int and type(lp) is float for entry in choice.logprobs for t, lp in entry.items())
    for i, (token, entry) in enumerate(zip(choice.token_ids, choice.logprobs, strict=True)):
        # transformers is the oracle: its log-softmax at this position, fp32 on both sides.
        expected = hf_logits(model, out.prompt_token_ids + choice.token_ids[:i])[-1].log_softmax(-1)
        top = expected.topk(3)
        assert set(entry) == set(top.indices.tolist())  # greedy: the sampled token is the top one
        assert max(entry, key=entry.get) == token
        for token_id, logprob in entry.items():
            assert logprob == pytest.approx(expected[token_id].item(), abs=1e-4)

    [sampled] = llm.generate(PROMPTS[0], SamplingParams(temperature=1.0, seed=3, max_tokens=6, logprobs=0))
    choice = sampled.outputs[0]
    assert [list(entry) for entry in choice.logprobs] == [[token] for token in choice.token_ids]
    assert all(lp <= 0 for entry in choice.logprobs for lp in entry.values())

    [sampled] = llm.generate(PROMPTS[0], SamplingParams(temperature=1.0, seed=3, max_tokens=6, logprobs=2))
    for token, entry in zip(sampled.outputs[0].token_ids, sampled.outputs[0].logprobs, strict=True):
        assert token in entry and len(entry) in (2, 3)  # top 2, plus the sampled token when not among them


def test_chat_renders_the_checkpoints_chat_template(llm):
    hello = [{"role": "user", "content": "Hello"}]
    story = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell a story"}]
    params = _greedy(5)
    [one] = llm.chat(hello, params)
    tokenizer = llm.get_tokenizer()
    rendered = tokenizer.decode(one.prompt_token_ids, skip_special_tokens=False)
    assert rendered == "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"

    both = llm.chat([hello, story], params)
    assert len(both) == 2
    assert tokenizer.decode(both[1].prompt_token_ids, skip_special_tokens=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nTell a story<|im_end|>\n"
        "<|im_start|>assistant\n")
    assert both[0].outputs[0].token_ids == one.outputs[0].token_ids
    [plain] = llm.generate(both[1].prompt_token_ids, params)
    assert both[1].outputs[0].token_ids == plain.outputs[0].token_ids


def test_n_choices_differ_and_a_seed_reproduces_them(llm, tiny_llama_checkpoint):
    params = SamplingParams(n=3, temperature=1.0, seed=1234, max_tokens=8, ignore_eos=True)
    [out] = llm.generate(PROMPTS[0], params)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    choices = [tuple(c.token_ids) for c in out.outputs]
    assert len(set(choices)) == 3, choices
    assert all(c.finish_reason == "length" and len(c.token_ids) == 8 for c in out.outputs)

    # Another LLM instance, and the request batched behind another one: the same choices.
    other = _make_llm(tiny_llama_checkpoint[0])
    again = other.generate([PROMPTS[1], PROMPTS[0]], [SamplingParams(max_tokens=4), params])[1]
    assert [tuple(c.token_ids) for c in again.outputs] == choices
    assert [c.text for c in again.outputs] == [c.text for c in out.outputs]

    [greedy] = llm.generate(PROMPTS[0], _greedy(6, n=2))
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids


def _full_greedy(llm: LLM, max_tokens: int = 20):  # CompletionOutput
    return llm.generate(PROMPTS[1], _greedy(max_tokens))[0].outputs[0]


def test_stop_string_ends_the_text_before_it(llm):
    full = _full_greedy(llm)
    # The first two-character window, past the start, that occurs nowhere earlier and is whole text.
    start = next(i for i in range(3, len(full.text) - 2)
                 if full.text.find(full.text[i:i + 2]) == i and "\ufffd" not in full.text[i:i + 2])
    stop = full.text[start:start + 2]

    [out] = llm.generate(PROMPTS[1], _greedy(20, stop=[stop, "never appears \u2603"]))
    choice = out.outputs[0]
    assert choice.finish_reason == "stop"
    assert choice.text == full.text[:start]
    assert choice.token_ids == full.token_ids[:len(choice.token_ids)] and len(choice.token_ids) < 20

    [kept] = llm.generate(PROMPTS[1], _greedy(20, stop=stop, include_stop_str_in_output=True))
    assert kept.outputs[0].text == full.text[:start + 2]
    assert kept.outputs[0].finish_reason == "stop"


def test_stop_token_ids_max_tokens_and_min_tokens(llm):
    full = _full_greedy(llm).token_ids
    position = next(i for i in range(2, len(full)) if full[i] not in full[:i])
    [out] = llm.generate(PROMPTS[1], _greedy(20, stop_token_ids=[full[position]]))
    assert out.outputs[0].token_ids == full[:position + 1]  # the stop token stays in the ids, as in vLLM
    assert out.outputs[0].finish_reason == "stop"

    [short] = llm.generate(PROMPTS[1], _greedy(3))
    assert short.outputs[0].token_ids == full[:3] and short.outputs[0].finish_reason == "length"

    # The first greedy token as a stop token: without min_tokens it ends the request at once;
    # with min_tokens=4 it is masked until four tokens exist.
    [first] = llm.generate(PROMPTS[1], _greedy(10, stop_token_ids=[full[0]]))
    assert first.outputs[0].token_ids == [full[0]] and first.outputs[0].finish_reason == "stop"
    [held] = llm.generate(PROMPTS[1], _greedy(10, stop_token_ids=[full[0]], min_tokens=4))
    held_ids = held.outputs[0].token_ids
    assert len(held_ids) >= 4 and full[0] not in held_ids[:4]


def test_eos_ends_a_request_unless_ignored_or_before_min_tokens(llm, tiny_llama_checkpoint, tmp_path):
    first_token = _full_greedy(llm, 1).token_ids[0]
    path = tmp_path / "eos"
    shutil.copytree(tiny_llama_checkpoint[0], path)
    # generation_config.json may list several EOS ids; make the model's first greedy token one of them.
    generation = json.loads((path / "generation_config.json").read_text())
    generation["eos_token_id"] = [1, first_token]
    (path / "generation_config.json").write_text(json.dumps(generation))
    eos_llm = _make_llm(path)

    stops = SamplingParams(temperature=0.0, max_tokens=10)
    [out] = eos_llm.generate(PROMPTS[1], stops)
    assert out.outputs[0].token_ids == [first_token] and out.outputs[0].finish_reason == "stop"

    [ignored] = eos_llm.generate(PROMPTS[1], _greedy(10))
    assert len(ignored.outputs[0].token_ids) == 10 and ignored.outputs[0].finish_reason == "length"

    [held] = eos_llm.generate(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=10, min_tokens=3))
    held_ids = held.outputs[0].token_ids
    assert len(held_ids) >= 3 and first_token not in held_ids[:3]


def test_a_prompt_longer_than_the_context_fails_alone(llm):
    too_long = [7] * (llm.engine.max_model_len + 1)
    outs = llm.generate([PROMPTS[0], too_long, PROMPTS[1]], _greedy(6))
    alone = llm.generate([PROMPTS[0], PROMPTS[1]], _greedy(6))
    bad = outs[1]
    assert bad.finished and bad.outputs[0].finish_reason == "error" and bad.outputs[0].token_ids == []
    assert "257 tokens" in bad.error and "256" in bad.error
    assert [o.error for o in (outs[0], outs[2])] == [None, None]
    assert [o.outputs[0].token_ids for o in (outs[0], outs[2])] == [o.outputs[0].token_ids for o in alone]


def test_max_tokens_none_runs_to_the_end_of_the_context(tiny_llama_checkpoint):
    short = _make_llm(tiny_llama_checkpoint[0], max_model_len=24)
    [out] = short.generate([5] * 10, SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 14 and out.outputs[0].finish_reason == "length"


@pytest.mark.parametrize(("field", "value"), [
    ("top_p", 0.0), ("top_p", 1.5), ("temperature", -0.5), ("n", 0), ("max_tokens", 0), ("max_tokens", -3),
])
def test_invalid_sampling_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}\b"):
        SamplingParams(**{field: value})


def test_token_ids_outside_the_vocabulary_are_rejected(llm):
    vocab = llm.engine.executor.vocab_size
    for prompt in ([5, vocab], [-1, 5]):
        with pytest.raises(ValueError, match=rf"\[0, {vocab}\)"):
            llm.generate([prompt], _greedy(2))


def test_a_rejected_batch_leaves_no_request_behind(tiny_llama_checkpoint):
    fresh = _make_llm(tiny_llama_checkpoint[0])
    with pytest.raises(ValueError):
        fresh.generate([[5, 6], [10**6]], _greedy(2))
    assert not fresh.engine.has_unfinished_requests()
    [out] = fresh.generate([[5, 6, 7]], _greedy(10))
    assert len(out.outputs[0].token_ids) == 10


def test_unknown_architecture_lists_the_registered_ones(unknown_architecture_checkpoint):
    with pytest.raises(Exception, match="FooForCausalLM") as excinfo:
        LLM(model=str(unknown_architecture_checkpoint), dtype="float32")
    assert "llama" in str(excinfo.value) and "mistral" in str(excinfo.value)


def test_invalid_config_value_names_the_field_path(tiny_llama_checkpoint):
    with pytest.raises(ValueError, match=r"cache\.block_size"):
        LLM(model=str(tiny_llama_checkpoint[0]), block_size=0)
    with pytest.raises(ValueError, match=r"scheduler\.max_num_seqs"):
        LLM(model=str(tiny_llama_checkpoint[0]), max_num_seqs=0)


def test_unknown_keyword_is_a_type_error(tiny_llama_checkpoint):
    with pytest.raises(TypeError, match="blocksize"):
        LLM(model=str(tiny_llama_checkpoint[0]), blocksize=8)


def test_keywords_reach_their_config_sections(llm):
    config = llm.config
    assert (config.dtype, config.cache.num_blocks, config.cache.block_size) == ("float32", 64, 8)
    assert config.cache.enable_prefix_caching is True
    assert llm.engine.executor.dtype == torch.float32


def test_prompt_logprobs_match_transformers_with_chunks_and_prefix_cache(tiny_llama_checkpoint):
    path, model = tiny_llama_checkpoint
    prompt = [(7 * i) % 500 + 10 for i in range(37)]
    with torch.inference_mode():
        expected = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    # A 16-token budget splits the prompt over three steps; the second request would hit the prefix cache.
    llm = _make_llm(path, max_num_batched_tokens=16)  # prefix caching is on in _make_llm
    for _ in range(2):
        [out] = llm.generate([prompt], _greedy(2, prompt_logprobs=3))
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        for position, entry in enumerate(out.prompt_logprobs[1:], start=1):
            token = prompt[position]
            assert entry[token] == pytest.approx(expected[position - 1, token].item(), abs=1e-4)
            top = expected[position - 1].topk(3).indices.tolist()
            assert set(top) <= set(entry)


def test_chat_renders_tools_through_the_template(llm):
    """LLM.chat(tools=...) puts the tools in the prompt the template builds; a template that does not read
    tools is a ValueError, not a prompt without them."""
    from pluginfer.text.tokenizer import render_chat

    tokenizer = llm.engine.tokenizer
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    hello = [{"role": "user", "content": "what time is it?"}]
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    kept = tokenizer.chat_template
    tokenizer.chat_template = ("{% if tools %}tools:{% for t in tools %} {{ t.function.name }}{% endfor %}\n{% endif %}"
                               "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:")
    try:
        [answer] = llm.chat(hello, params, tools=tools)
        expected = tokenizer.encode(render_chat(tokenizer, hello, tools=tools), add_special_tokens=False)
        assert answer.prompt_token_ids == expected
        assert "tools: get_time" in tokenizer.decode(answer.prompt_token_ids)
        tokenizer.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
        with pytest.raises(ValueError, match="does not render tools"):
            llm.chat(hello, params, tools=tools)
    finally:
        tokenizer.chat_template = kept
