"""``pluginfer bench serve``, ``bench throughput`` and ``chat --base-url`` against a fake server.

The fake OpenAI-compatible server (aiohttp, 127.0.0.1, a free port, its own thread) streams one
chunk per token after DELAY seconds each, then a finish chunk, a usage chunk and ``[DONE]``. The
requested model name picks how it misbehaves. Timing checks are relations (TTFT >= DELAY, p99 >=
median), never upper bounds on wall-clock time.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import re
import sys
import threading

import pytest
from aiohttp import web

from pluginfer.cli import main

DELAY = 0.01  # seconds before each streamed token
VOCAB = 50  # what /v1/models reports; prompts must stay below it
BEHAVIOURS = ["ok", "no-usage", "bundled", "http-400", "http-500", "sse-error", "no-done", "garbage", "flaky",
              "slow"]
LOCKED_KEY = "sk-locked"


class FakeOpenAI:
    def __init__(self) -> None:
        self.url = ""
        self.reset()

    def reset(self) -> None:
        self.requests: list[dict] = []
        self.in_flight = self.max_in_flight = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        # The same server behind an API key, as `pluginfer serve --api-key` answers without it.
        app.router.add_get("/locked/v1/models", self._locked(self.models))
        app.router.add_post("/locked/v1/completions", self._locked(self.completions))
        return app

    @staticmethod
    def _locked(handler):
        async def check(request: web.Request) -> web.StreamResponse:
            if request.headers.get("Authorization") != f"Bearer {LOCKED_KEY}":
                return web.json_response({"error": {
                    "message": "missing or invalid API key (send Authorization: Bearer <key>)",
                    "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}, status=401)
            return await handler(request)
        return check

    async def models(self, request: web.Request) -> web.Response:
        data = [{"id": name, "object": "model", "owned_by": "test", "vocab_size": VOCAB} for name in BEHAVIOURS]
        return web.json_response({"object": "list", "data": data})

    @staticmethod
    async def _send(response: web.StreamResponse, event: dict | str) -> None:
        await response.write(f"data: {event if isinstance(event, str) else json.dumps(event)}\n\n".encode())

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        behaviour = body["model"]
        if behaviour == "flaky" and len(self.requests) % 2 == 0:
            behaviour = "http-500"
        if behaviour in ("http-400", "http-500"):
            status = int(behaviour[-3:])
            return web.json_response({"error": {"message": f"fake {status}", "type": "x", "code": status}},
                                     status=status)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            if behaviour == "slow":
                await asyncio.sleep(1.0)
            tokens = body["max_tokens"]
            per_chunk = 2 if behaviour == "bundled" else 1
            for index in range(0, tokens, per_chunk):
                await asyncio.sleep(DELAY)
                if behaviour == "garbage" and index == 1:
                    await self._send(response, "{not json")
                    await self._send(response, {"choices": 3})
                if behaviour == "sse-error" and index == 1:
                    await self._send(response, {"error": {"message": "fake engine failure", "code": 500}})
                    return response
                text = "".join(f"t{i} " for i in range(index, min(index + per_chunk, tokens)))
                await self._send(response, {"id": "cmpl-1", "object": "text_completion", "model": behaviour,
                                            "choices": [{"index": 0, "text": text, "finish_reason": None}]})
            await self._send(response, {"id": "cmpl-1", "object": "text_completion", "model": behaviour,
                                        "choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
            if behaviour != "no-usage":
                usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": tokens,
                         "total_tokens": len(body["prompt"]) + tokens}
                await self._send(response, {"id": "cmpl-1", "object": "text_completion", "choices": [],
                                            "usage": usage})
            if behaviour != "no-done":
                await self._send(response, "[DONE]")
            return response
        finally:
            self.in_flight -= 1

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        if body["model"] == "http-400":
            return web.json_response({"error": {"message": "fake 400"}}, status=400)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        turn = sum(m["role"] == "user" for m in body["messages"])
        chunk = {"id": "chat-1", "object": "chat.completion.chunk", "model": body["model"]}
        await self._send(response, {**chunk, "choices": [{"index": 0, "delta": {"role": "assistant"}}]})
        for word in ["Hello", " there", f", turn {turn}"]:
            await asyncio.sleep(DELAY)
            await self._send(response, {**chunk, "choices": [{"index": 0, "delta": {"content": word},
                                                              "finish_reason": None}]})
        await self._send(response, {**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
        await self._send(response, "[DONE]")
        return response


@pytest.fixture(scope="module")
def running_server():
    fake = FakeOpenAI()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start() -> web.AppRunner:
        runner = web.AppRunner(fake.app())
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        return runner

    runner = asyncio.run_coroutine_threadsafe(start(), loop).result(30)
    fake.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    yield fake
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(30)
    loop.close()


@pytest.fixture
def server(running_server: FakeOpenAI) -> FakeOpenAI:
    running_server.reset()
    return running_server


def bench(server: FakeOpenAI, tmp_path, *flags: str) -> tuple[int, dict]:
    out = tmp_path / "bench.json"
    status = main(["bench", "serve", "--base-url", server.url, "--json", str(out), *flags])
    return status, json.loads(out.read_text())


def test_concurrency_run_reports_exact_counts_and_plausible_latencies(server, tmp_path, capsys):
    status, figures = bench(server, tmp_path, "--concurrency", "4", "--input-len", "7", "--output-len", "5",
                            "--num-prompts", "8")
    assert status == 0
    assert figures["model"] == "ok"  # the first of /v1/models
    assert (figures["successful_requests"], figures["failed_requests"]) == (8, 0)
    assert (figures["total_input_tokens"], figures["total_output_tokens"]) == (8 * 7, 8 * 5)
    assert len(server.requests) == 8
    for body in server.requests:
        assert len(body["prompt"]) == 7 and all(isinstance(t, int) and 0 <= t < VOCAB for t in body["prompt"])
        assert body["stream"] is True and body["ignore_eos"] is True and body["max_tokens"] == 5
        assert body["stream_options"] == {"include_usage": True}
    assert 1 < server.max_in_flight <= 4
    delay_ms = DELAY * 1000 * 0.99  # timers may fire a clock tick early
    assert figures["ttft_ms"]["mean"] >= delay_ms and figures["itl_ms"]["median"] >= delay_ms
    assert figures["tpot_ms"]["mean"] >= delay_ms
    assert figures["e2e_latency_ms"]["mean"] >= 5 * delay_ms
    for name in ["ttft_ms", "itl_ms", "tpot_ms", "e2e_latency_ms"]:
        stats = figures[name]
        assert stats["p99"] >= stats["median"] > 0, name
    assert figures["e2e_latency_ms"]["median"] >= figures["ttft_ms"]["median"]
    assert figures["duration_s"] * 1000 >= figures["e2e_latency_ms"]["p99"]
    assert figures["output_token_throughput"] == pytest.approx(40 / figures["duration_s"])
    assert all(r["ok"] and r["output_tokens"] == 5 for r in figures["requests"])
    shown = capsys.readouterr().out
    assert "Successful requests:" in shown and "P99 TTFT (ms):" in shown and "Mean ITL (ms):" in shown


def test_output_tokens_come_from_usage_else_from_chunks(server, tmp_path):
    _, bundled = bench(server, tmp_path, "--model", "bundled", "--concurrency", "2", "--input-len", "3",
                       "--output-len", "6", "--num-prompts", "2")
    assert bundled["total_output_tokens"] == 2 * 6  # 3 chunks of 2 tokens each; usage says 6
    _, counted = bench(server, tmp_path, "--model", "no-usage", "--concurrency", "2", "--input-len", "3",
                       "--output-len", "4", "--num-prompts", "2")
    assert counted["successful_requests"] == 2 and counted["total_output_tokens"] == 2 * 4


@pytest.mark.parametrize("behaviour, message", [("http-400", "HTTP 400: fake 400"),
                                                ("http-500", "HTTP 500: fake 500"),
                                                ("sse-error", "stream error: fake engine failure"),
                                                ("no-done", "without data: [DONE]"),
                                                ("garbage", "JSONDecodeError")])
def test_errors_are_counted_not_raised(server, tmp_path, capsys, behaviour, message):
    status, figures = bench(server, tmp_path, "--model", behaviour, "--concurrency", "3", "--input-len", "4",
                            "--output-len", "3", "--num-prompts", "5")
    assert status == 1
    assert (figures["successful_requests"], figures["failed_requests"]) == (0, 5)
    assert len(server.requests) == 5
    [(error, count)] = figures["errors"].items()
    assert message in error and count == 5
    assert figures["ttft_ms"]["mean"] is None and figures["total_output_tokens"] == 0
    assert "Failed requests:" in capsys.readouterr().out


@pytest.mark.parametrize(("key", "says"), [
    ([], "the server refused the API key (none was sent: pass --api-key): 401 missing or invalid API key"),
    (["--api-key", "sk-wrong"], "the server refused the API key: 401 missing or invalid API key"),
])
def test_a_refused_api_key_is_said_before_any_request(server, capsys, key, says):
    flags = ["--concurrency", "2", "--input-len", "4", "--output-len", "3", "--num-prompts", "4"]
    for model in ([], ["--model", "ok"]):  # with a model named, /v1/models is still asked first
        status = main(["bench", "serve", "--base-url", server.url + "/locked", *model, *key, *flags])
        [line] = capsys.readouterr().err.strip().splitlines()
        assert status == 2 and line.startswith("pluginfer: error: ") and says in line, line
    assert server.requests == []
    assert main(["bench", "serve", "--base-url", server.url + "/locked", "--api-key", LOCKED_KEY, *flags]) == 0
    assert len(server.requests) == 4


def test_an_all_failed_run_says_why_first(server, tmp_path, capsys):
    status, figures = bench(server, tmp_path, "--model", "http-400", "--concurrency", "2", "--input-len", "4",
                            "--output-len", "3", "--num-prompts", "3")
    assert status == 1 and figures["failed_requests"] == 3
    shown = capsys.readouterr()
    said = [line for line in shown.err.splitlines() if not PROGRESS.fullmatch(line)]
    assert said[0] == "pluginfer: all 3 requests failed: HTTP 400: fake 400"


PROGRESS = re.compile(r"pluginfer: (\d+)/(\d+) requests done \((\d+) failed\), \d+\.\d s")


def test_the_settings_are_shown_first_and_progress_while_it_runs(server, tmp_path, capsys):
    status, figures = bench(server, tmp_path, "--model", "flaky", "--concurrency", "2", "--input-len", "4",
                            "--output-len", "3", "--num-prompts", "6")
    assert status == 1 and figures["failed_requests"] == 3
    shown = capsys.readouterr()
    assert shown.out.splitlines()[0] == (f"pluginfer bench serve: {server.url}, model flaky, 6 requests, "
                                         "concurrency 2, input 4 tokens, output 3 tokens")
    progress = [PROGRESS.fullmatch(line) for line in shown.err.splitlines()]
    assert all(progress), shown.err  # not a terminal: one plain line per completed request (6 < 10 * 1)
    counts = [(int(m[1]), int(m[2]), int(m[3])) for m in progress]
    assert [done for done, _, _ in counts] == [1, 2, 3, 4, 5, 6] and {total for _, total, _ in counts} == {6}
    failed = [f for _, _, f in counts]
    assert failed == sorted(failed) and failed[-1] == 3

    bench(server, tmp_path, "--request-rate", "500", "--input-len", "2", "--output-len", "2", "--num-prompts", "30")
    shown = capsys.readouterr()
    assert "30 requests, 500 requests/s, input 2 tokens" in shown.out.splitlines()[0]
    lines = shown.err.splitlines()  # every 3rd of 30 requests
    assert [int(PROGRESS.fullmatch(line)[1]) for line in lines] == list(range(3, 31, 3))


def test_progress_on_a_terminal_is_one_rewritten_line(server, tmp_path, monkeypatch):
    controller, terminal = os.openpty()
    with open(terminal, "w") as stream:
        monkeypatch.setattr(sys, "stderr", stream)
        status, _ = bench(server, tmp_path, "--concurrency", "2", "--input-len", "3", "--output-len", "2",
                          "--num-prompts", "4")
        monkeypatch.undo()
    assert status == 0
    shown = b""
    while not shown.endswith(b"\n"):
        shown += os.read(controller, 4096)
    os.close(controller)
    text = shown.decode().replace("\r\n", "\n")  # the terminal writes a newline as \r\n
    assert text.startswith("\r") and text.endswith("\n") and text.count("\n") == 1
    updates = text.rstrip("\n").split("\r")[1:]
    assert [int(PROGRESS.fullmatch(update)[1]) for update in updates] == [1, 2, 3, 4]


def test_some_failures_leave_the_rest_measured(server, tmp_path):
    status, figures = bench(server, tmp_path, "--model", "flaky", "--concurrency", "2", "--input-len", "4",
                            "--output-len", "3", "--num-prompts", "6")
    assert status == 1
    assert (figures["successful_requests"], figures["failed_requests"]) == (3, 3)
    assert figures["total_output_tokens"] == 3 * 3 and figures["ttft_ms"]["median"] > 0


def test_a_request_past_the_timeout_fails(server, tmp_path):
    status, figures = bench(server, tmp_path, "--model", "slow", "--concurrency", "2", "--input-len", "4",
                            "--output-len", "2", "--num-prompts", "2", "--timeout", "0.2")
    assert status == 1 and figures["failed_requests"] == 2
    assert "Timeout" in next(iter(figures["errors"]))


def test_rate_mode_sends_every_request(server, tmp_path):
    status, figures = bench(server, tmp_path, "--request-rate", "200", "--input-len", "5", "--output-len", "3",
                            "--num-prompts", "10", "--seed", "3", "--vocab-size", "7")
    assert status == 0
    assert len(server.requests) == 10 and figures["successful_requests"] == 10
    assert figures["request_rate"] == 200 and figures["concurrency"] is None
    assert figures["vocab_size"] == VOCAB  # the server's figure wins over --vocab-size
    assert figures["total_input_tokens"] == 50 and figures["total_output_tokens"] == 30


def test_same_seed_same_prompts(server, tmp_path):
    flags = ["--concurrency", "1", "--input-len", "6", "--output-len", "1", "--num-prompts", "3", "--seed", "5"]
    bench(server, tmp_path, *flags)
    first = [body["prompt"] for body in server.requests]
    server.reset()
    bench(server, tmp_path, *flags)
    assert [body["prompt"] for body in server.requests] == first


def test_a_tokenizer_keeps_special_tokens_out_of_prompts(server, tmp_path, tiny_tokenizer_dir):
    from pluginfer.text.tokenizer import load_tokenizer

    special = set(load_tokenizer(tiny_tokenizer_dir).all_special_ids)
    assert special and max(special) < VOCAB
    bench(server, tmp_path, "--tokenizer", str(tiny_tokenizer_dir), "--concurrency", "2", "--input-len", "40",
          "--output-len", "1", "--num-prompts", "4")
    drawn = {token for body in server.requests for token in body["prompt"]}
    assert drawn and not drawn & special and max(drawn) < VOCAB


def test_offline_throughput_counts_tokens(tiny_llama_checkpoint, tmp_path, capsys):
    out = tmp_path / "throughput.json"
    status = main(["bench", "throughput", "--model", str(tiny_llama_checkpoint[0]), "--dtype", "float32",
                   "--num-blocks", "64", "--block-size", "8", "--input-len", "12", "--output-len", "5",
                   "--num-prompts", "4", "--json", str(out)])
    assert status == 0
    figures = json.loads(out.read_text())
    assert (figures["successful_requests"], figures["failed_requests"]) == (4, 0)
    assert (figures["total_input_tokens"], figures["total_output_tokens"]) == (4 * 12, 4 * 5)
    assert figures["output_token_throughput"] == pytest.approx(20 / figures["elapsed_s"])
    assert figures["total_token_throughput"] == pytest.approx(68 / figures["elapsed_s"])
    assert "Output token throughput (tok/s):" in capsys.readouterr().out


def test_remote_chat_streams_and_keeps_the_conversation(server, monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("hi\nand again\n\nnot read\n"))
    status = main(["chat", "--base-url", server.url + "/v1", "--system", "be brief", "--max-tokens", "9"])
    assert status == 0
    assert capsys.readouterr().out == "Hello there, turn 1\nHello there, turn 2\n"
    first, second = server.requests
    assert first["model"] == "ok" and first["stream"] is True and first["max_tokens"] == 9
    assert second["messages"] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                                  {"role": "assistant", "content": "Hello there, turn 1"},
                                  {"role": "user", "content": "and again"}]


def test_remote_chat_reports_a_refused_turn(server, monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("hi\n"))
    status = main(["chat", "--base-url", server.url, "--model", "http-400"])
    assert status == 1
    assert "HTTP 400: fake 400" in capsys.readouterr().err


def test_sse_events_join_their_data_lines_and_skip_comments_and_other_fields():
    from pluginfer.cli.openai_client import sse_data

    async def lines():
        for line in [b": keep-alive\n", b"event: message\n", b"data: {\"a\":\n", b"data:  1}\n", b"\n", b"\n",
                     b"id: 7\r\n", b"data: [DONE]\r\n", b"\r\n", b"data: unterminated"]:
            yield line

    async def collect():
        return [data async for data in sse_data(lines())]

    assert asyncio.run(collect()) == ['{"a":\n 1}', "[DONE]", "unterminated"]
