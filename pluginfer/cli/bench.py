"""``pluginfer bench serve`` (load on a running OpenAI-compatible server) and ``bench throughput`` (offline).

Prompts are lists of random token ids, so input lengths are exact without a tokenizer on the client.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    import aiohttp

DEFAULT_VOCAB_SIZE = 1000  # small enough to be valid for any real model


def _positive(kind: type) -> Callable[[str], int | float]:
    def parse(text: str) -> int | float:
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value
    return parse


def _workload_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input-len", type=_positive(int), required=True, help="prompt tokens per request")
    parser.add_argument("--output-len", type=_positive(int), required=True, help="generated tokens per request")
    parser.add_argument("--num-prompts", type=_positive(int), required=True, help="number of requests")
    parser.add_argument("--json", dest="json_path", default=None, help="also write every figure to this file")


def register(commands: argparse._SubParsersAction, add_engine_arguments: Callable) -> None:
    bench = commands.add_parser("bench", help="measure a running server (serve) or the engine offline (throughput)")
    kinds = bench.add_subparsers(dest="bench_command", required=True, metavar="KIND")

    serve = kinds.add_parser("serve", help="load an OpenAI-compatible server: TTFT, ITL, TPOT, throughput")
    serve.add_argument("--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000")
    load = serve.add_mutually_exclusive_group(required=True)
    load.add_argument("--concurrency", type=_positive(int), help="keep this many requests in flight")
    load.add_argument("--request-rate", type=_positive(float), help="Poisson arrivals, requests per second")
    _workload_arguments(serve)
    serve.add_argument("--model", default=None, help="model name to request (default the first of /v1/models)")
    serve.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    serve.add_argument("--tokenizer", default=None, help="tokenizer directory: draw no special token ids")
    serve.add_argument("--vocab-size", type=_positive(int), default=None,
                       help="draw ids below this when /v1/models reports no vocab_size "
                            f"(default the tokenizer's size, else {DEFAULT_VOCAB_SIZE})")
    serve.add_argument("--seed", type=int, default=0, help="seed of the prompts and arrival times")
    serve.add_argument("--timeout", type=_positive(float), default=1800.0, help="seconds per request at most")
    serve.set_defaults(run=run_serve)

    throughput = kinds.add_parser("throughput", help="offline: generate for all prompts at once, report tokens/s",
                                  usage="%(prog)s --model MODEL --input-len N --output-len N [options]")
    add_engine_arguments(throughput)  # its --seed seeds the engine and the prompts
    _workload_arguments(throughput)
    throughput.set_defaults(run=run_throughput)


def token_pool(vocab_size: int, tokenizer: object | None = None) -> Sequence[int]:
    """Ids to draw prompts from: below the vocabulary, without the tokenizer's special tokens."""
    if tokenizer is None:
        return range(vocab_size)
    special = set(getattr(tokenizer, "all_special_ids", []))
    return [i for i in range(min(vocab_size, len(tokenizer))) if i not in special]


def random_prompts(pool: Sequence[int], input_len: int, num_prompts: int, rng: random.Random) -> list[list[int]]:
    return [rng.choices(pool, k=input_len) for _ in range(num_prompts)]


# ---------------------------------------------------------------- serve: one request


@dataclass
class RequestResult:
    """One streamed request; times in seconds from when it was sent."""

    ok: bool = False
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)  # gaps between consecutive chunks that carry tokens
    error: str = ""


def _carries_token(event: dict) -> bool:
    """A chunk with a choice that has text, or no finish_reason yet (a token that decodes to no text)."""
    return any(choice.get("text") or choice.get("finish_reason") is None for choice in event.get("choices") or [])


async def send_completion(session: aiohttp.ClientSession, url: str, payload: dict, headers: dict[str, str],
                          timeout: float) -> RequestResult:
    """POST one streamed completion and time its chunks; a failure is recorded, never raised."""
    import aiohttp

    from pluginfer.cli.openai_client import REQUEST_ERRORS, error_message, sse_data

    result = RequestResult(prompt_tokens=len(payload["prompt"]))
    start = last = time.perf_counter()
    chunks, usage, done = 0, None, False
    try:
        async with session.post(url, json=payload, headers=headers,
                                timeout=aiohttp.ClientTimeout(total=timeout)) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {error_message(await response.text())}"
                return result
            async for data in sse_data(response.content):
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if not isinstance(event, dict) or "error" in event:
                    result.error = f"stream error: {error_message(event)}"
                    return result
                now = time.perf_counter()
                if _carries_token(event):
                    if chunks == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    chunks, last = chunks + 1, now
                if isinstance(event.get("usage"), dict):
                    usage = event["usage"]
    # TypeError, AttributeError: a chunk of the wrong shape (e.g. "choices": 3)
    except (*REQUEST_ERRORS, ValueError, TypeError, AttributeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        return result
    result.latency = time.perf_counter() - start
    if usage:
        result.prompt_tokens = usage.get("prompt_tokens", result.prompt_tokens)
        result.output_tokens = usage.get("completion_tokens", chunks)
    else:
        result.output_tokens = chunks
    if not done:
        result.error = "the stream ended without data: [DONE]"
    elif chunks == 0:
        result.error = "no token was streamed"
    result.ok = not result.error
    return result


# ---------------------------------------------------------------- serve: the load


class Progress:
    """Completed requests on a stream: a ``\r`` counter on a terminal, else a line every ``every`` requests."""

    def __init__(self, total: int, stream: TextIO, every: int | None = None) -> None:
        self.total, self.stream, self.done, self.failed = total, stream, 0, 0
        self.tty = stream.isatty()
        self.every = every or max(1, total // 10)
        self.start = time.perf_counter()

    def __call__(self, result: RequestResult) -> None:
        self.done += 1
        self.failed += not result.ok
        if not self.tty and self.done % self.every and self.done != self.total:
            return
        line = (f"pluginfer: {self.done}/{self.total} requests done ({self.failed} failed), "
                f"{time.perf_counter() - self.start:.1f} s")
        end = "\n" if not self.tty or self.done == self.total else ""
        print(("\r" if self.tty else "") + line, end=end, file=self.stream, flush=True)


async def run_load(url: str, payloads: list[dict], headers: dict[str, str], timeout: float, *,
                   concurrency: int | None = None, request_rate: float | None = None,
                   rng: random.Random | None = None,
                   on_done: Callable[[RequestResult], None] | None = None) -> tuple[list[RequestResult], float]:
    """Send every payload, ``concurrency`` at a time or at Poisson arrivals; (results, seconds). ``on_done``
    is called with each result as it completes."""
    import aiohttp

    rng = rng or random.Random(0)

    async def send(session: aiohttp.ClientSession, payload: dict) -> RequestResult:
        result = await send_completion(session, url, payload, headers, timeout)
        if on_done is not None:
            on_done(result)
        return result

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        start = time.perf_counter()
        if concurrency:
            queue: Iterator[dict] = iter(payloads)  # shared by the workers: each takes the next payload

            async def worker() -> list[RequestResult]:
                return [await send(session, payload) for payload in queue]

            groups = await asyncio.gather(*(worker() for _ in range(min(concurrency, len(payloads)))))
            results = [result for group in groups for result in group]
        else:
            assert request_rate, "either concurrency or request_rate"
            tasks = []
            for index, payload in enumerate(payloads):
                if index:
                    await asyncio.sleep(rng.expovariate(request_rate))
                tasks.append(asyncio.create_task(send(session, payload)))
            results = list(await asyncio.gather(*tasks))
        return results, time.perf_counter() - start


def _percentile(ordered: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def _stats_ms(seconds: list[float]) -> dict[str, float | None]:
    if not seconds:
        return {"mean": None, "median": None, "p99": None}
    ordered = sorted(s * 1000 for s in seconds)
    return {"mean": statistics.fmean(ordered), "median": statistics.median(ordered), "p99": _percentile(ordered, 99)}


def summarize(results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    input_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    return {
        "successful_requests": len(ok),
        "failed_requests": len(results) - len(ok),
        "duration_s": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration,
        "input_token_throughput": input_tokens / duration,
        "output_token_throughput": output_tokens / duration,
        "ttft_ms": _stats_ms([r.ttft for r in ok]),
        "itl_ms": _stats_ms([gap for r in ok for gap in r.itl]),
        "tpot_ms": _stats_ms([(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]),
        "e2e_latency_ms": _stats_ms([r.latency for r in ok]),
        "errors": dict(Counter(r.error for r in results if not r.ok).most_common()),
    }


def _print_table(title: str, rows: list[tuple[str, object]]) -> None:
    print(f"{'=' * 12} {title} {'=' * max(0, 46 - len(title))}")
    for label, value in rows:
        if label.startswith("--"):
            print(label[2:].center(60, "-"))
            continue
        shown = "-" if value is None else f"{value:.2f}" if isinstance(value, float) else value
        print(f"{label + ':':<44}{shown:>16}")
    print("=" * 60)


def print_serve_summary(summary: dict) -> None:
    rows: list[tuple[str, object]] = [
        ("Successful requests", summary["successful_requests"]),
        ("Failed requests", summary["failed_requests"]),
        ("Benchmark duration (s)", summary["duration_s"]),
        ("Total input tokens", summary["total_input_tokens"]),
        ("Total output tokens", summary["total_output_tokens"]),
        ("Request throughput (req/s)", summary["request_throughput"]),
        ("Input token throughput (tok/s)", summary["input_token_throughput"]),
        ("Output token throughput (tok/s)", summary["output_token_throughput"]),
        *_speculation_rows(summary),
    ]
    for key, name in [("ttft_ms", "TTFT"), ("itl_ms", "ITL"), ("tpot_ms", "TPOT"), ("e2e_latency_ms", "E2E latency")]:
        rows.append((f"--{name}", None))
        rows += [(f"{stat.capitalize() if stat != 'p99' else 'P99'} {name} (ms)", value)
                 for stat, value in summary[key].items()]
    _print_table("Serving benchmark", rows)
    for message, count in summary["errors"].items():
        print(f"{count} failed: {message}")


def run_serve(args: argparse.Namespace) -> int:
    from pluginfer.cli.openai_client import api_root, auth_headers, fetch_models

    root = api_root(args.base_url)
    models = fetch_models(root, args.api_key)
    model = args.model or (models[0].get("id") if models else None)
    if not model:
        raise ValueError(f"{root}/v1/models lists no model: pass --model")
    tokenizer = None
    if args.tokenizer:
        from pluginfer.text.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(args.tokenizer)
    card = next((m for m in models if m.get("id") == model), {})
    vocab_size = (card.get("vocab_size") if isinstance(card.get("vocab_size"), int) else args.vocab_size
                  or (len(tokenizer) if tokenizer is not None else DEFAULT_VOCAB_SIZE))
    rng = random.Random(args.seed)
    prompts = random_prompts(token_pool(vocab_size, tokenizer), args.input_len, args.num_prompts, rng)
    payloads = [{"model": model, "prompt": prompt, "max_tokens": args.output_len, "stream": True,
                 "stream_options": {"include_usage": True}, "ignore_eos": True} for prompt in prompts]
    load = f"concurrency {args.concurrency}" if args.concurrency else f"{args.request_rate:g} requests/s"
    print(f"pluginfer bench serve: {root}, model {model}, {args.num_prompts} requests, {load}, "
          f"input {args.input_len} tokens, output {args.output_len} tokens", flush=True)
    before = spec_counters(root, args.api_key)
    results, duration = asyncio.run(run_load(
        f"{root}/v1/completions", payloads, auth_headers(args.api_key), args.timeout,
        concurrency=args.concurrency, request_rate=args.request_rate, rng=rng,
        on_done=Progress(len(payloads), sys.stderr)))
    summary = summarize(results, duration)
    summary.update(speculation_summary(before, spec_counters(root, args.api_key)))
    if results and not summary["successful_requests"]:  # the reason first, not under a table of dashes
        reason, _ = next(iter(summary["errors"].items()))
        print(f"pluginfer: all {len(results)} requests failed: {reason}", file=sys.stderr)
    if args.json_path:
        # before printing: a closed stdout (`| head`) must not lose the file
        setup = {"base_url": root, "model": model, "concurrency": args.concurrency,
                 "request_rate": args.request_rate, "input_len": args.input_len, "output_len": args.output_len,
                 "num_prompts": args.num_prompts, "seed": args.seed, "vocab_size": vocab_size}
        requests = [{k: v for k, v in asdict(r).items() if k != "itl"} for r in results]
        with open(args.json_path, "w") as out:
            json.dump({**setup, **summary, "requests": requests}, out, indent=2)
    print_serve_summary(summary)
    return 1 if summary["failed_requests"] else 0


SPEC_COUNTERS = ("pluginfer_spec_decode_num_drafts_total", "pluginfer_spec_decode_num_draft_tokens_total",
                 "pluginfer_spec_decode_num_accepted_tokens_total")


def spec_counters(root: str, api_key: str | None) -> tuple[float, ...] | None:
    """The server's speculative-decoding counters from /metrics (drafts, draft tokens, accepted), or None."""
    import urllib.request

    from pluginfer.cli.openai_client import auth_headers

    try:
        request = urllib.request.Request(f"{root}/metrics", headers=auth_headers(api_key))
        with urllib.request.urlopen(request, timeout=10) as response:
            text = response.read().decode()
    except Exception:  # noqa: BLE001 - a server without /metrics still gets its load figures
        return None
    values = dict(line.rsplit(" ", 1) for line in text.splitlines() if line.startswith(SPEC_COUNTERS))
    return tuple(float(values[name]) for name in SPEC_COUNTERS) if len(values) == 3 else None


def speculation_summary(before: tuple | None, after: tuple | None) -> dict:
    """Acceptance rate and mean accepted length over the run, when drafts were made in it."""
    if before is None or after is None or after[0] == before[0]:
        return {}
    drafts, tokens, accepted = (a - b for a, b in zip(after, before))
    return {"spec_acceptance_rate": accepted / tokens, "spec_mean_accepted_length": 1 + accepted / drafts}


def _speculation_rows(summary: dict) -> list[tuple[str, object]]:
    if "spec_acceptance_rate" not in summary:
        return []
    return [("Draft acceptance rate", summary["spec_acceptance_rate"]),
            ("Mean accepted length (tokens/step)", summary["spec_mean_accepted_length"])]


# ---------------------------------------------------------------- throughput (offline)


def run_throughput(args: argparse.Namespace) -> int:
    from pluginfer import LLM, SamplingParams
    from pluginfer.cli import engine_overrides

    llm = LLM(args.model, args.config, **{k: v for k, v in engine_overrides(args).items() if k != "model"})
    pool = token_pool(llm.engine.executor.vocab_size, llm.get_tokenizer())
    rng = random.Random(args.seed or 0)
    prompts = random_prompts(pool, args.input_len, args.num_prompts, rng)
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
    llm.generate(random_prompts(pool, args.input_len, 1, rng), SamplingParams(max_tokens=2, ignore_eos=True))
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    failed = [o for o in outputs if o.error]
    input_tokens = sum(len(o.prompt_token_ids) for o in outputs if not o.error)
    output_tokens = sum(len(c.token_ids) for o in outputs if not o.error for c in o.outputs)
    summary = {
        "model": str(llm.config.model), "input_len": args.input_len, "output_len": args.output_len,
        "num_prompts": args.num_prompts, "successful_requests": len(outputs) - len(failed),
        "failed_requests": len(failed), "elapsed_s": elapsed,
        "total_input_tokens": input_tokens, "total_output_tokens": output_tokens,
        "request_throughput": (len(outputs) - len(failed)) / elapsed,
        "output_token_throughput": output_tokens / elapsed,
        "total_token_throughput": (input_tokens + output_tokens) / elapsed,
        "errors": dict(Counter(o.error for o in failed)),
    }
    stats = llm.engine.stats()
    summary.update(speculation_summary((0, 0, 0), (stats.spec_drafts, stats.spec_draft_tokens,
                                                   stats.spec_accepted_tokens)))
    if args.json_path:
        with open(args.json_path, "w") as out:
            json.dump(summary, out, indent=2)
    _print_table("Offline throughput", [
        ("Successful requests", summary["successful_requests"]), ("Failed requests", summary["failed_requests"]),
        ("Elapsed (s)", elapsed), ("Total input tokens", input_tokens), ("Total output tokens", output_tokens),
        ("Request throughput (req/s)", summary["request_throughput"]),
        ("Output token throughput (tok/s)", summary["output_token_throughput"]),
        ("Total token throughput (tok/s)", summary["total_token_throughput"]),
        *_speculation_rows(summary),
    ])
    for message, count in summary["errors"].items():
        print(f"{count} failed: {message}")
    return 1 if failed else 0
