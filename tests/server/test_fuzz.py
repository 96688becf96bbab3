"""schemathesis against OpenAI's published spec (shared/data/openai-openapi.json): a few hundred generated
requests per operation (chat, completions, embeddings, models, responses), then hypothesis on /tokenize and /detokenize.
Only 2xx and 4xx answers are allowed; after each batch the server is alive, answers an ordinary request, and
every KV block is free again (read from /metrics). The long run is benchmarks/fuzz.py (docs/reliability.md)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.conftest import MODEL_NAME, http

SPEC = Path(os.environ.get("PLUGINFER_OPENAI_SPEC", Path(__file__).resolve().parents[3] / "shared" / "data" / "openai-openapi.json"))
OPERATIONS = ["createChatCompletion", "createCompletion", "createEmbedding", "listModels", "retrieveModel",
              "createResponse", "getResponse", "deleteResponse"]
EXAMPLES = int(os.environ.get("PLUGINFER_FUZZ_EXAMPLES", "25"))  # per operation and phase


def kv_blocks(server) -> tuple[float, float]:
    """(free, total) KV blocks as /metrics says."""
    status, _, raw = http(server, "GET", "/metrics")
    assert status == 200
    text = raw.decode()
    values = {name: float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))
              for name in ("pluginfer_kv_cache_free_blocks", "pluginfer_kv_cache_blocks")}
    return values["pluginfer_kv_cache_free_blocks"], values["pluginfer_kv_cache_blocks"]


def assert_healthy(server, timeout: float = 30.0) -> None:
    """Alive, serving an ordinary request, and every KV block free once the aborted work is gone."""
    assert http(server, "GET", "/health")[0] == 200
    status, _, raw = http(server, "POST", "/v1/completions",
                          {"model": MODEL_NAME, "prompt": [11, 12], "max_tokens": 2, "temperature": 0})
    assert status == 200, raw
    deadline = time.monotonic() + timeout
    while (blocks := kv_blocks(server))[0] != blocks[1]:
        assert time.monotonic() < deadline, f"KV blocks not all free after the batch: {blocks}"
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.skipif(not SPEC.is_file(), reason=f"OpenAI's spec is not at {SPEC}")
@pytest.mark.parametrize("operation", OPERATIONS)
def test_schemathesis_finds_no_server_error(server, operation, tmp_path):
    statuses_before = _statuses(server)
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "tests.server.fuzz_hooks", "PLUGINFER_FUZZ_MODEL": MODEL_NAME,
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [sys.executable, "-m", "schemathesis.cli", "run", str(SPEC), "--url", f"{server.url}/v1",
         "--include-operation-id", operation, "--max-examples", str(EXAMPLES), "--checks", "not_a_server_error",
         "--request-timeout", "60", "--seed", "15", "--no-color"],
        capture_output=True, text=True, timeout=900, env=env,
        cwd=tmp_path)  # its example database (.schemathesis/) goes there, not into the checkout
    summary = re.search(r"(\d+) generated, (\d+) passed", result.stdout)
    assert result.returncode == 0 and summary, result.stdout[-3000:] + result.stderr[-2000:]
    assert int(summary.group(1)) == int(summary.group(2)) > 0
    statuses = _statuses(server)
    answered = {status: count - statuses_before.get(status, 0) for status, count in statuses.items()}
    assert not any(status >= 500 and count for status, count in answered.items()), answered
    assert_healthy(server)


def _statuses(server) -> dict[int, float]:
    text = http(server, "GET", "/metrics")[2].decode()
    totals: dict[int, float] = {}
    for status, count in re.findall(r'^pluginfer_requests_total\{route="[^"]*",status="(\d+)"\} (\S+)$', text, re.M):
        totals[int(status)] = totals.get(int(status), 0) + float(count)
    return totals


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
                           max_leaves=12)
tokenize_bodies = st.fixed_dictionaries({}, optional={
    "model": st.sampled_from([MODEL_NAME, "", "other", "/etc/passwd"]) | st.text(),
    "prompt": st.text() | json_values,
    "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "robot"]),
                                                "content": st.text() | json_values}), max_size=3) | json_values,
    "add_special_tokens": st.booleans() | json_values,
    "add_generation_prompt": st.booleans() | json_values,
    "chat_template_kwargs": st.dictionaries(st.text(), json_values, max_size=2) | json_values,
    "tokens": st.lists(st.integers(), max_size=8) | json_values,
    "extra": json_values,
})


@settings(max_examples=int(os.environ.get("PLUGINFER_FUZZ_EXAMPLES", "25")) * 4, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(body=tokenize_bodies, path=st.sampled_from(["/tokenize", "/detokenize"]))
def test_tokenize_and_detokenize_answer_2xx_or_4xx(server, body, path):
    status, _, raw = http(server, "POST", path, body)
    assert status < 500, raw
    if status >= 400:
        error = json.loads(raw)["error"]
        assert set(error) == {"message", "type", "param", "code"}


numbers = st.integers() | st.floats(allow_nan=True, allow_infinity=True) | st.none() | st.text(max_size=3)
sampling_fields = {name: numbers | json_values for name in (
    "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "seed", "n", "min_tokens", "logprobs", "top_logprobs")}
sampling_fields.update(
    stop=st.text(max_size=4) | st.lists(st.text(max_size=4), max_size=4) | json_values,
    stop_token_ids=st.lists(st.integers(), max_size=4) | json_values,
    logit_bias=st.dictionaries(st.integers().map(str) | st.text(max_size=3), numbers, max_size=3) | json_values,
    stream=st.booleans() | json_values, stream_options=json_values, response_format=json_values,
    structured_outputs=json_values, ignore_eos=st.booleans() | json_values, echo=st.booleans() | json_values)


@settings(max_examples=int(os.environ.get("PLUGINFER_FUZZ_EXAMPLES", "25")) * 20, deadline=None)
@given(fields=st.fixed_dictionaries({}, optional=sampling_fields),
       chat=st.booleans(), prompt=st.text(max_size=8) | st.lists(st.integers(0, 100), min_size=1, max_size=4))
def test_request_models_raise_only_validation_errors(fields, chat, prompt):
    """Any JSON values in the sampling fields end in a request's SamplingParams, a pydantic ValidationError or
    an APIError (a 4xx) from the request models and the limits; never another exception (a 500)."""
    from pydantic import ValidationError

    from pluginfer.core.config import SamplingDefaults, ServerConfig
    from pluginfer.server.errors import APIError
    from pluginfer.server.limits import check_limits
    from pluginfer.server.protocol import ChatCompletionRequest, CompletionRequest

    if chat:
        fields = {key: value for key, value in fields.items() if key not in ("logprobs", "echo")}
        body, model = {"messages": [{"role": "user", "content": "hi"}], **fields}, ChatCompletionRequest
    else:
        fields = {key: value for key, value in fields.items() if key not in ("max_completion_tokens", "top_logprobs")}
        body, model = {"prompt": prompt, **fields}, CompletionRequest
    try:
        request = model.model_validate(body)
        check_limits(request, ServerConfig(), 256, len(getattr(request, "prompt", [None])))
        params = request.sampling_params(SamplingDefaults(), 20)
    except (ValidationError, APIError) as exc:
        if isinstance(exc, APIError):
            assert 400 <= exc.status < 500
        return
    assert params.n == request.n >= 1 and params.max_tokens >= 1
