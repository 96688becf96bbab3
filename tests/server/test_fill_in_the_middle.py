"""``suffix`` on /v1/completions through the openai client: the greedy middle of a tiny random checkpoint whose
tokenizer has Qwen2.5-Coder's or StarCoder2's fill-in-the-middle tokens equals transformers' greedy ``generate``
on the family's documented prompt; a model without them, ``echo`` and token-id prompts are 400s naming the field."""

from __future__ import annotations

import openai
import pytest
from transformers import AutoTokenizer

from pluginfer.server.launch import BackgroundServer
from tests.checkpoints import hf_greedy, save_hf_model
from tests.conftest import TINY_LLAMA
from tests.server.conftest import MODEL_NAME, make_client, server_config, start_engine
from tests.text.test_fim import FAMILY_TOKENS, PREFIX, SUFFIX, fim_tokenizer_dir

MAX_TOKENS = 12


@pytest.fixture(scope="module", params=sorted(FAMILY_TOKENS))
def fim_server(request, tiny_tokenizer_dir, tmp_path_factory):
    """(client, lenient client, transformers model, transformers tokenizer, family) of a served checkpoint of that
    family; the lenient client reads legacy completion chunks, whose finish_reason null the strict types refuse."""
    family = request.param
    tokenizer_dir = fim_tokenizer_dir(tiny_tokenizer_dir, tmp_path_factory.mktemp(f"{family}_tok"), family)
    out = tmp_path_factory.mktemp(f"{family}_fim")
    model = save_hf_model("LlamaForCausalLM", TINY_LLAMA, out, tokenizer_dir)
    engine = start_engine(server_config(out))
    server = BackgroundServer(engine, server_config(out))
    with make_client(server) as client, make_client(server, strict=False) as lenient:
        yield client, lenient, model, AutoTokenizer.from_pretrained(str(out)), family
    server.stop()
    engine.shutdown()


def _expected(model, tokenizer, family: str, prefix: str, suffix: str) -> tuple[list[int], str, str]:
    """(prompt ids, middle text, finish reason) by transformers: the documented prompt string tokenized, its
    greedy continuation up to the first token that ends a middle (the family's or EOS)."""
    pre, suf, mid, *stops = FAMILY_TOKENS[family]
    prompt = tokenizer.encode(pre + prefix + suf + suffix + mid, add_special_tokens=False)
    generated = hf_greedy(model, prompt, MAX_TOKENS)
    ends = {*tokenizer.convert_tokens_to_ids(stops), tokenizer.eos_token_id}
    cut = next((i for i, token in enumerate(generated) if token in ends), None)
    text = tokenizer.decode(generated[:cut], skip_special_tokens=True)
    return prompt, text, "length" if cut is None else "stop"


@pytest.mark.parametrize(("prefix", "suffix"), [(PREFIX, SUFFIX), ("x = [", " 1, 2]")])
def test_middle_is_transformers_greedy_continuation(fim_server, prefix, suffix):
    client, lenient, model, tokenizer, family = fim_server
    prompt, text, reason = _expected(model, tokenizer, family, prefix, suffix)
    response = client.completions.create(model=MODEL_NAME, prompt=prefix, suffix=suffix, max_tokens=MAX_TOKENS,
                                         temperature=0)
    [choice] = response.choices
    assert response.usage.prompt_tokens == len(prompt)
    assert (choice.text, choice.finish_reason) == (text, reason)
    streamed = lenient.completions.create(model=MODEL_NAME, prompt=prefix, suffix=suffix, max_tokens=MAX_TOKENS,
                                         temperature=0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == text


def test_a_fim_stop_token_ends_the_middle(fim_server):
    """The middle ends at the family's end token (raised by logit_bias so random weights write it)."""
    client, _, _, tokenizer, family = fim_server
    stop = tokenizer.convert_tokens_to_ids(FAMILY_TOKENS[family][3])
    response = client.completions.create(model=MODEL_NAME, prompt=PREFIX, suffix=SUFFIX, max_tokens=MAX_TOKENS,
                                         temperature=0, logit_bias={str(stop): 100})
    assert (response.choices[0].text, response.choices[0].finish_reason) == ("", "stop")
    assert response.usage.completion_tokens == 1


@pytest.mark.parametrize(("fields", "param", "says"), [
    ({"echo": True}, "echo", "echo is not supported with suffix"),
    ({"prompt": [1, 2, 3]}, "prompt", "suffix needs the prompt as text"),
])
def test_suffix_with_what_it_cannot_serve_is_400(fim_server, fields, param, says):
    client = fim_server[0]
    request = {"model": MODEL_NAME, "prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 2, **fields}
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(**request)
    assert raised.value.body["param"] == param and says in raised.value.body["message"]
    assert client.completions.create(model=MODEL_NAME, prompt=PREFIX, suffix=SUFFIX, max_tokens=2).choices


def test_a_model_without_fim_tokens_is_400_naming_suffix(tiny_llama_checkpoint):
    engine = start_engine(server_config(tiny_llama_checkpoint[0]))
    server = BackgroundServer(engine, server_config(tiny_llama_checkpoint[0]))
    try:
        with make_client(server) as client:
            with pytest.raises(openai.BadRequestError) as raised:
                client.completions.create(model=MODEL_NAME, prompt=PREFIX, suffix=SUFFIX, max_tokens=2)
            assert raised.value.body["param"] == "suffix"
            assert "no fill-in-the-middle tokens" in raised.value.body["message"]
            # an empty suffix asks for nothing: a plain completion
            assert client.completions.create(model=MODEL_NAME, prompt=PREFIX, suffix="", max_tokens=2).choices
    finally:
        server.stop()
        engine.shutdown()
