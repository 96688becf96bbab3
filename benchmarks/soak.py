"""Soak: many concurrent streaming clients on loopback for a while, some leaving mid-stream, some cancelling.

    python benchmarks/soak.py --model demo --duration 600 --clients 64        # starts `pluginfer serve` itself
    python benchmarks/soak.py --url http://127.0.0.1:8000 --duration 60       # an existing server

Each client loops until the time is up, drawing a request: chat or completions, streamed, prompts of 4 to
``--max-prompt`` tokens and outputs of 8 to ``--max-output``; ``--disconnect`` of them (20 %) close the
connection after a few events, ``--cancel`` (5 %) give up before their first token, ``--multi`` (15 %) ask
for n = 2..4 choices with stop strings. Reported: requests completed, failed (an HTTP error, an error event,
or a stream without [DONE] that the client did not leave), disconnected and cancelled; every KV block free
at the end (/metrics); the server's RSS (with its engine process) at the start, the end, its peak and once a
minute (the KV cache's pages count from when they are first written, so the RSS climbs by up to the cache's
size before it levels off; a leak keeps climbing); p50 and p99 time to first token and inter-token latency
as the clients saw them. Exit status 1 if a request failed or a block was left held. ``--json`` writes the
report. Linux only (RSS from /proc).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

import aiohttp

WORDS = ("the cat sat on a mat while rain fell over hills and rivers ran toward the sea under grey "
         "skies as people walked home").split()


@dataclass
class SoakReport:
    duration_s: float = 0.0
    clients: int = 0
    completed: int = 0
    failed: int = 0
    disconnected: int = 0
    cancelled: int = 0
    failures: list[str] = field(default_factory=list)  # the first few, for the log
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    kv_blocks_free: float = -1.0
    kv_blocks_total: float = -1.0
    rss_mib: dict[str, float] = field(default_factory=dict)

    def summary(self) -> dict:
        def pct(values: list[float], q: float) -> float | None:
            return round(statistics.quantiles(values, n=100)[q - 1] * 1000, 1) if len(values) >= 2 else None

        data = {k: v for k, v in asdict(self).items() if k not in ("ttft_s", "itl_s")}
        data.update(ttft_ms_p50=pct(self.ttft_s, 50), ttft_ms_p99=pct(self.ttft_s, 99),
                    itl_ms_p50=pct(self.itl_s, 50), itl_ms_p99=pct(self.itl_s, 99),
                    requests=self.completed + self.failed + self.disconnected + self.cancelled,
                    all_blocks_free=self.kv_blocks_free == self.kv_blocks_total)
        return data


def rss_mib(pid: int) -> float:
    """Resident memory of ``pid`` and its descendants (the engine core process), in MiB."""
    total, stack = 0, [pid]
    while stack:
        current = stack.pop()
        try:
            with open(f"/proc/{current}/status") as handle:
                total += next(int(line.split()[1]) for line in handle if line.startswith("VmRSS:"))
            for task in os.listdir(f"/proc/{current}/task"):
                with open(f"/proc/{current}/task/{task}/children") as handle:
                    stack += [int(child) for child in handle.read().split()]
        except (FileNotFoundError, ProcessLookupError, StopIteration):
            continue
    return total / 1024


async def metrics(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with session.get(f"{url}/metrics") as response:
        text = await response.text()
    return {name: float(value) for name, value in re.findall(r"^(pluginfer_[a-z_]+) (\S+)$", text, re.M)}


async def one_request(session: aiohttp.ClientSession, url: str, model: str, rng: random.Random,
                      args: argparse.Namespace, report: SoakReport) -> None:
    prompt_len = rng.randint(4, args.max_prompt)
    body: dict = {"model": model, "max_tokens": rng.randint(8, args.max_output), "stream": True,
                  "temperature": 1.0, "seed": rng.randrange(1 << 30), "ignore_eos": rng.random() < 0.5}
    if rng.random() < 0.5:
        path = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": " ".join(rng.choices(WORDS, k=prompt_len))}]
    else:
        path = "/v1/completions"
        body["prompt"] = [rng.randrange(10, args.vocab) for _ in range(prompt_len)]
    draw = rng.random()
    disconnect = draw < args.disconnect
    cancel = args.disconnect <= draw < args.disconnect + args.cancel
    if rng.random() < args.multi:
        body.update(n=rng.randint(2, 4), stop=rng.sample(WORDS, 3))
    task = asyncio.current_task()
    if cancel:  # give up before the first token: the request is abandoned while it waits or prefills
        asyncio.get_running_loop().call_later(rng.uniform(0.0, 0.05), task.cancel)
    started = time.perf_counter()
    last = None
    events = 0
    try:
        async with session.post(url + path, json=body) as response:
            if response.status != 200:
                raise RuntimeError(f"HTTP {response.status}: {(await response.text())[:200]}")
            done = False
            async for raw in response.content:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                payload = line[len("data: "):]
                if payload == "[DONE]":
                    done = True
                    break
                event = json.loads(payload)
                if "error" in event:
                    raise RuntimeError(f"error event: {event['error']['message'][:200]}")
                now = time.perf_counter()
                if last is None:
                    report.ttft_s.append(now - started)
                else:
                    report.itl_s.append(now - last)
                last = now
                events += 1
                if disconnect and events >= 2:
                    response.close()  # leave mid-stream: the server must abort and free the blocks
                    report.disconnected += 1
                    return
            if not done:
                raise RuntimeError("the stream ended without [DONE]")
        report.completed += 1
    except asyncio.CancelledError:
        if not cancel:
            raise
        report.cancelled += 1
    except Exception as exc:  # noqa: BLE001 - every failure is counted and the first ones are shown
        report.failed += 1
        if len(report.failures) < 10:
            report.failures.append(f"{path}: {type(exc).__name__}: {exc}")


async def client(url: str, model: str, seed: int, deadline: float, args: argparse.Namespace,
                 report: SoakReport) -> None:
    rng = random.Random(seed)
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        while time.monotonic() < deadline:
            try:
                await asyncio.create_task(one_request(session, url, model, rng, args, report))
            except asyncio.CancelledError:
                if asyncio.current_task().cancelling():
                    raise


async def soak(url: str, args: argparse.Namespace, server_pid: int | None = None) -> SoakReport:
    """Run the clients against ``url`` for ``args.duration`` seconds; then wait for the server to be idle."""
    report = SoakReport(clients=args.clients)
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{url}/v1/models") as response:
            card = (await response.json())["data"][0]
        model = card["id"]
        args.vocab = min(card.get("vocab_size") or 1000, 30000)
        rss: list[float] = [rss_mib(server_pid)] if server_pid else []
        started = time.monotonic()
        deadline = started + args.duration
        clients = [asyncio.create_task(client(url, model, args.seed * 1000 + i, deadline, args, report))
                   for i in range(args.clients)]
        while not all(task.done() for task in clients):
            await asyncio.sleep(1.0)
            if server_pid:
                rss.append(rss_mib(server_pid))
        await asyncio.gather(*clients)
        report.duration_s = round(time.monotonic() - started, 1)
        settle = time.monotonic() + 30
        while True:  # aborted requests free their blocks within a step or two
            values = await metrics(session, url)
            report.kv_blocks_free = values["pluginfer_kv_cache_free_blocks"]
            report.kv_blocks_total = values["pluginfer_kv_cache_blocks"]
            if report.kv_blocks_free == report.kv_blocks_total or time.monotonic() > settle:
                break
            await asyncio.sleep(0.2)
        if server_pid:
            rss.append(rss_mib(server_pid))
            report.rss_mib = {"start": round(rss[0], 1), "end": round(rss[-1], 1), "peak": round(max(rss), 1),
                              "growth": round(rss[-1] - rss[0], 1),
                              "by_minute": [round(value, 1) for value in rss[::60]]}  # a leak keeps climbing
    return report


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    command = [sys.executable, "-m", "pluginfer", "serve", "--model", args.model, "--port", "0",
               "--max-num-seqs", str(args.max_num_seqs), *args.serve_args]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    line = process.stdout.readline()
    if "serving" not in line:
        process.kill()
        raise SystemExit(f"the server did not start: {line!r}")
    return process, line.split(" on ")[-1].strip()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running server")
    where.add_argument("--model", help="start `pluginfer serve --model MODEL` on a free port")
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load (default 600)")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--disconnect", type=float, default=0.2, help="fraction that leave mid-stream")
    parser.add_argument("--cancel", type=float, default=0.05, help="fraction that give up before a token")
    parser.add_argument("--multi", type=float, default=0.15, help="fraction with n = 2..4 and stop strings")
    parser.add_argument("--max-prompt", type=int, default=256, help="longest prompt, in tokens (words for chat)")
    parser.add_argument("--max-output", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=64, help="the started server's batch (with --model)")
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the report here")
    parser.add_argument("serve_args", nargs="*", help="more `pluginfer serve` flags after --, with --model")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    process = None
    url = args.url
    if args.model:
        process, url = start_server(args)
    try:
        report = asyncio.run(soak(url, args, process.pid if process else None))
    finally:
        if process is not None:
            process.terminate()
            process.wait(timeout=60)
    summary = report.summary()
    print(json.dumps(summary, indent=2))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(summary, handle, indent=2)
    return 0 if report.failed == 0 and summary["all_blocks_free"] else 1


if __name__ == "__main__":
    sys.exit(main())
