"""Each sampling field a request sends reaches the engine and has its effect, end to end, through the official
openai client, on both endpoints, streamed and not, at TP 1 and TP 2 (the package's engine fixture).

The oracle is the offline engine: ``LLM.generate`` with the same ``SamplingParams`` on the same prompt tokens
must give the same text, finish reasons and logprobs (greedy and seeded sampling are deterministic; a seeded
sequence draws from its own generator). Each test also shows the field changes the answer on this prompt
(compared with the answer without it), so a server that dropped the field fails: it would answer as if the
field were absent.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import pytest

from pluginfer import LLM, SamplingParams
from tests.server.conftest import MODEL_NAME, http, make_client

# A prompt (token ids) and a chat message on which the tiny llama's greedy continuation changes within
# MAX_TOKENS under every penalty, presence and frequency giving different answers at -2 (found by trying
# random prompts: most greedy continuations repeat no token so early, and a positive penalty then does nothing).
PROMPT = [204, 1276, 1647, 523, 1873, 1100, 1454, 1669]
MESSAGES = [{"role": "user", "content": "fold jalapeño, the"}]
MAX_TOKENS = 12
# Request fields the openai client takes as keywords; the rest go in extra_body (vLLM's names).
OPENAI_FIELDS = {"temperature", "top_p", "seed", "presence_penalty", "frequency_penalty", "logit_bias", "n",
                 "max_tokens", "stop"}


@dataclass
class Answer:
    texts: list[str]
    finish_reasons: list[str]
    completion_tokens: int
    # per choice, per token: (sampled token's logprob, {token text: logprob} of the top alternatives)
    logprobs: list[list[tuple[float, dict[str, float]]]] = field(default_factory=list)


@pytest.fixture(scope="module")
def offline(tiny_llama_checkpoint) -> LLM:
    llm = LLM(model=str(tiny_llama_checkpoint[0]), dtype="float32", num_blocks=64, block_size=8)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def chat_prompt(server) -> list[int]:
    status, _, body = http(server, "POST", "/tokenize", {"messages": MESSAGES})
    assert status == 200, body
    return json.loads(body)["tokens"]


@pytest.fixture(params=["completions", "chat"])
def endpoint(request) -> str:
    return request.param


@pytest.fixture(params=[False, True], ids=["whole", "stream"])
def stream(request) -> bool:
    return request.param


@pytest.fixture
def ask(server, endpoint, stream, chat_prompt):
    """``ask(**fields)`` -> the server's Answer; ``ask.prompt``: the prompt's token ids for the oracle."""
    # Legacy completion streams carry finish_reason null mid-stream, which the strict client refuses.
    client = make_client(server, strict=not (stream and endpoint == "completions"))

    def call(logprobs: int | None = None, **fields: Any) -> Answer:
        fields.setdefault("max_tokens", MAX_TOKENS)
        kwargs = {k: v for k, v in fields.items() if k in OPENAI_FIELDS}
        extra = {k: v for k, v in fields.items() if k not in OPENAI_FIELDS}
        if stream:
            kwargs.update(stream=True, stream_options={"include_usage": True})
        if endpoint == "chat":
            if logprobs is not None:
                kwargs.update(logprobs=True, top_logprobs=logprobs)
            result = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, extra_body=extra, **kwargs)
        else:
            if logprobs is not None:
                kwargs["logprobs"] = logprobs
            result = client.completions.create(model=MODEL_NAME, prompt=PROMPT, extra_body=extra, **kwargs)
        return read_stream(result, endpoint) if stream else read_whole(result, endpoint)

    call.prompt = chat_prompt if endpoint == "chat" else PROMPT
    yield call
    client.close()


def chat_entries(logprobs: Any) -> list[tuple[float, dict[str, float]]]:
    return [(e.logprob, {t.token: t.logprob for t in e.top_logprobs}) for e in (logprobs.content or [])]


def completion_entries(logprobs: Any) -> list[tuple[float, dict[str, float]]]:
    return list(zip(logprobs.token_logprobs, logprobs.top_logprobs))


def read_whole(response: Any, endpoint: str) -> Answer:
    choices = sorted(response.choices, key=lambda c: c.index)
    texts = [c.message.content if endpoint == "chat" else c.text for c in choices]
    entries = [] if choices[0].logprobs is None else [
        (chat_entries if endpoint == "chat" else completion_entries)(c.logprobs) for c in choices]
    return Answer(texts, [c.finish_reason for c in choices], response.usage.completion_tokens, entries)


def read_stream(chunks: Any, endpoint: str) -> Answer:
    texts: dict[int, str] = {}
    finishes: dict[int, list[str]] = {}
    entries: dict[int, list] = {}
    usage = None
    for chunk in chunks:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            piece = choice.delta.content if endpoint == "chat" else choice.text
            texts[choice.index] = texts.get(choice.index, "") + (piece or "")
            if choice.finish_reason is not None:
                finishes.setdefault(choice.index, []).append(choice.finish_reason)
            if choice.logprobs is not None:
                read = chat_entries if endpoint == "chat" else completion_entries
                entries.setdefault(choice.index, []).extend(read(choice.logprobs))
    assert all(len(f) == 1 for f in finishes.values()), finishes  # exactly one finish per choice
    order = sorted(texts)
    return Answer([texts[i] for i in order], [finishes[i][0] for i in order], usage.completion_tokens,
                  [entries[i] for i in order] if entries else [])


def oracle(llm: LLM, prompt: list[int], **fields: Any) -> tuple[Answer, list]:
    """The offline engine's answer to the same fields (vLLM's names are SamplingParams' names)."""
    fields.setdefault("max_tokens", MAX_TOKENS)
    logprobs = fields.pop("logprobs", None)
    if "logit_bias" in fields:
        fields["logit_bias"] = {int(k): v for k, v in fields["logit_bias"].items()}
    [output] = llm.generate([prompt], SamplingParams(logprobs=logprobs, **fields))
    choices = output.outputs
    answer = Answer([c.text for c in choices], [c.finish_reason for c in choices],
                    sum(len(c.token_ids) for c in choices))
    if logprobs is not None:
        text_of = llm.engine.tokenizer.decode
        for c in choices:
            tops = [sorted(entry.items(), key=lambda item: -item[1])[:logprobs] for entry in c.logprobs]
            answer.logprobs.append([(entry[token], {text_of([t]): v for t, v in top})
                                    for token, entry, top in zip(c.token_ids, c.logprobs, tops, strict=True)])
    return answer, choices


def assert_same(ours: Answer, expected: Answer) -> None:
    assert ours.texts == expected.texts
    assert ours.finish_reasons == expected.finish_reasons
    assert ours.completion_tokens == expected.completion_tokens


GREEDY = {"temperature": 0.0, "ignore_eos": True}
SAMPLED = {"temperature": 1.0, "seed": 1234, "ignore_eos": True}


def test_greedy_equals_the_offline_engine(ask, offline):
    assert_same(ask(**GREEDY), oracle(offline, ask.prompt, **GREEDY)[0])


def test_logit_bias_forces_and_bans_a_token(ask, offline):
    greedy, greedy_choices = oracle(offline, ask.prompt, **GREEDY)
    forced_token = next(t for t in range(300, 400) if t not in greedy_choices[0].token_ids)
    forced = {**GREEDY, "logit_bias": {str(forced_token): 100}}
    expected, choices = oracle(offline, ask.prompt, **forced)
    assert choices[0].token_ids == [forced_token] * MAX_TOKENS
    assert_same(ask(**forced), expected)
    banned = {**GREEDY, "logit_bias": {str(greedy_choices[0].token_ids[0]): -100}}
    expected, choices = oracle(offline, ask.prompt, **banned)
    assert choices[0].token_ids[0] != greedy_choices[0].token_ids[0]
    assert_same(ask(**banned), expected)


def test_top_k_1_top_p_tiny_and_min_p_1_sample_the_greedy_answer(ask, offline):
    greedy = oracle(offline, ask.prompt, **GREEDY)[0]
    assert oracle(offline, ask.prompt, **SAMPLED)[0].texts != greedy.texts  # sampling does differ here
    for narrowing in ({"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}):
        assert_same(ask(**SAMPLED, **narrowing), greedy)


def test_top_k_top_p_and_min_p_shape_a_seeded_sample(ask, offline):
    for narrowing in ({"top_k": 3}, {"top_p": 0.3}, {"min_p": 0.2}):
        expected = oracle(offline, ask.prompt, **SAMPLED, **narrowing)[0]
        assert expected.texts != oracle(offline, ask.prompt, **SAMPLED)[0].texts, narrowing
        assert_same(ask(**SAMPLED, **narrowing), expected)


def test_a_seed_reproduces_a_sample_and_another_seed_differs(ask, offline):
    first, again = ask(**SAMPLED), ask(**SAMPLED)
    assert_same(first, oracle(offline, ask.prompt, **SAMPLED)[0])
    assert_same(again, first)
    other = ask(**{**SAMPLED, "seed": 4321})
    assert other.texts != first.texts
    assert_same(other, oracle(offline, ask.prompt, **{**SAMPLED, "seed": 4321})[0])


def test_temperature_changes_a_seeded_sample(ask, offline):
    hot = {**SAMPLED, "temperature": 1.8}
    expected = oracle(offline, ask.prompt, **hot)[0]
    assert expected.texts != oracle(offline, ask.prompt, **SAMPLED)[0].texts
    assert_same(ask(**hot), expected)


@pytest.mark.parametrize("penalty", [{"presence_penalty": 2.0}, {"presence_penalty": -2.0},
                                     {"frequency_penalty": 2.0}, {"frequency_penalty": -2.0},
                                     {"repetition_penalty": 2.0}, {"repetition_penalty": 0.5}],
                         ids=lambda p: "=".join(map(str, next(iter(p.items())))))
def test_penalties_change_the_greedy_answer_as_offline(ask, offline, penalty):
    expected = oracle(offline, ask.prompt, **GREEDY, **penalty)[0]
    assert expected.texts != oracle(offline, ask.prompt, **GREEDY)[0].texts, "no effect on this prompt"
    assert_same(ask(**GREEDY, **penalty), expected)


def test_presence_and_frequency_penalties_are_not_confused(ask, offline):
    """On this prompt they differ at -2: a server that sent one for the other fails."""
    presence = oracle(offline, ask.prompt, **GREEDY, presence_penalty=-2.0)[0]
    frequency = oracle(offline, ask.prompt, **GREEDY, frequency_penalty=-2.0)[0]
    if presence.texts == frequency.texts:
        pytest.fail("the penalties agree on this prompt: pick another PROMPT")
    assert_same(ask(**GREEDY, presence_penalty=-2.0), presence)
    assert_same(ask(**GREEDY, frequency_penalty=-2.0), frequency)


def test_a_stop_token_id_ends_the_answer(ask, offline):
    _, choices = oracle(offline, ask.prompt, **GREEDY)
    tokens = choices[0].token_ids
    index = next(i for i in range(3, MAX_TOKENS) if tokens[i] not in tokens[:i])  # first seen at index
    stop = {**GREEDY, "stop_token_ids": [tokens[index]]}
    expected, cut = oracle(offline, ask.prompt, **stop)
    assert cut[0].token_ids == tokens[: index + 1] and expected.finish_reasons == ["stop"]
    ours = ask(**stop)
    assert_same(ours, expected)
    assert ours.completion_tokens == index + 1


def test_min_tokens_holds_off_a_stop_token(ask, offline):
    _, choices = oracle(offline, ask.prompt, **GREEDY)
    first = choices[0].token_ids[0]
    stop = {**GREEDY, "stop_token_ids": [first]}
    assert ask(**stop).completion_tokens == 1  # the first token stops it...
    held = {**stop, "min_tokens": 5}
    expected, held_choices = oracle(offline, ask.prompt, **held)
    assert len(held_choices[0].token_ids) >= 5 and held_choices[0].token_ids[0] != first
    ours = ask(**held)  # ...unless min_tokens masks it for the first five
    assert_same(ours, expected)
    assert ours.completion_tokens >= 5


def test_ignore_eos_and_skip_special_tokens(ask, offline):
    """EOS forced by logit_bias: it ends the answer at once (its text skipped as a special token), unless
    ignore_eos; with skip_special_tokens false its text is in the answer."""
    [eos] = offline.engine.eos_token_ids
    forced = {"temperature": 0.0, "logit_bias": {str(eos): 100}}
    for fields in (forced, {**forced, "ignore_eos": True}, {**forced, "ignore_eos": True, "skip_special_tokens": False}):
        expected, choices = oracle(offline, ask.prompt, **fields)
        assert_same(ask(**fields), expected)
    assert expected.texts[0] == offline.engine.tokenizer.decode([eos]) * MAX_TOKENS  # the last: all kept
    assert oracle(offline, ask.prompt, **forced)[0].completion_tokens == 1


def test_stop_strings_and_include_stop_str_in_output(ask, offline):
    text = oracle(offline, ask.prompt, **GREEDY)[0].texts[0]
    stop = text[len(text) // 2: len(text) // 2 + 2]
    for fields in ({**GREEDY, "stop": [stop]}, {**GREEDY, "stop": [stop], "include_stop_str_in_output": True}):
        expected = oracle(offline, ask.prompt, **fields)[0]
        assert expected.finish_reasons == ["stop"]
        assert_same(ask(**fields), expected)
    assert expected.texts[0] == text[: text.index(stop) + len(stop)]


@pytest.mark.parametrize("max_tokens", [1, 7])
def test_max_tokens_is_the_length(ask, offline, max_tokens):
    ours = ask(**GREEDY, max_tokens=max_tokens)
    assert ours.completion_tokens == max_tokens and ours.finish_reasons == ["length"]
    assert_same(ours, oracle(offline, ask.prompt, **GREEDY, max_tokens=max_tokens)[0])


def test_n_choices_are_the_offline_engines_seeded_samples(ask, offline):
    ours = ask(**SAMPLED, n=3)
    expected = oracle(offline, ask.prompt, **SAMPLED, n=3)[0]
    assert len(set(expected.texts)) == 3
    assert_same(ours, expected)
    assert ours.completion_tokens == 3 * MAX_TOKENS


@pytest.mark.parametrize("count", [0, 1, 5])
def test_logprobs_count_and_values_are_the_engines(ask, offline, count):
    ours = ask(**GREEDY, logprobs=count)
    expected = oracle(offline, ask.prompt, **GREEDY, logprobs=count)[0]
    assert_same(ours, expected)
    [entries] = ours.logprobs
    [expected_entries] = expected.logprobs
    assert len(entries) == MAX_TOKENS
    for (logprob, top), (expected_logprob, expected_top) in zip(entries, expected_entries, strict=True):
        assert logprob == pytest.approx(expected_logprob, abs=1e-4)  # TP 2: fp32 rounding of the logits
        assert len(top) == len(expected_top) <= count  # fewer only where two tokens read the same text
        assert top.keys() == expected_top.keys()
        assert list(top.values()) == pytest.approx(list(expected_top.values()), abs=1e-4)
    if count:
        assert all(len(top) == count for _, top in entries[:3])
