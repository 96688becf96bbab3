"""Where a streamed token's CPU goes at concurrency 1: the engine core, the API server and the client,
per generated token, beside the offline engine's CPU per token of the same requests.

    python benchmarks/serve_token_cpu.py --gguf /tmp/pluginfer-serve-bench/smol135m-q4_1.gguf
    python benchmarks/serve_token_cpu.py --gguf FILE --variants process llamacpp --rounds 3
    python benchmarks/serve_token_cpu.py --variants process process:PYTHONPATH=/tmp/old-checkout --no-offline

CPU time (each thread's run time from /proc's schedstat, in ns; the server's kernel share from its stime,
in clock ticks) is what a process used, whoever else ran on
the machine at the time, so these figures hold on a shared machine where wall-clock latency does not.
The servers are started once, together (idle, neither spins), and measured in turn each round. Each round:
- the offline engine (``LLM``'s engine stepped directly, a child process) runs ``--requests`` requests of
  ``--gen`` tokens at batch 1, greedy, the prompt below: its process CPU per generated token (prefill
  included) and per decode step, and its median decode step (wall);
- the engine core's serving-only work per step, on the same engine: ``EngineCore._send_outputs`` (the
  step's deltas, pickled, written to a socket pair another thread drains), CPU of the stepping thread;
- each server (``process``: ``pluginfer serve`` as shipped; ``llamacpp``: ``python -m llama_cpp.server``
  when it imports) serves the same requests, one at a time, to the benchmark's client (the official
  ``openai`` package, AsyncOpenAI, streaming ``/v1/completions`` as ``serve_vs_llamacpp.py`` does; with
  ``--client-kind raw`` serve_client.py's minimal HTTP client ``stream_one_raw``), in a process of its own: the CPU per generated token of the server process (the API server), of its children
  (pluginfer's engine core), and of the client, and the client's median inter-token latency.
The idle OpenMP threads of the offline engine and of the engine core spin the same (libgomp's default,
300000 spins) before they sleep: that spin is in both figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from serve_client import PROMPT, stream_one, stream_one_raw
from serve_processes import Server, free_port, load_average


def run_seconds(pid: int, descendants: bool = False) -> float:
    """The scheduler's run time (ns, /proc/*/task/*/schedstat) of every thread of a process, and with
    ``descendants`` of every process below it, in seconds."""
    total, pending = 0, [pid]
    while pending:
        current = pending.pop()
        try:
            for task in Path(f"/proc/{current}/task").iterdir():
                total += int((task / "schedstat").read_text().split()[0])
                if descendants:
                    pending += [int(child) for child in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):  # it ended meanwhile
            continue
    return total / 1e9


def process_cpu_seconds(pid: int) -> tuple[float, float]:
    """(CPU, of which in the kernel) of one process (all its threads, none of its children), in seconds: the
    first from the scheduler's nanosecond run time of each thread (schedstat), the second in clock ticks."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return run_seconds(pid), int(fields[12]) / os.sysconf("SC_CLK_TCK")


# -- the offline engine (a child: `--offline GGUF REQUESTS GEN`) ------------------------------------


def offline(gguf: str, requests: int, gen: int) -> dict[str, float]:
    from pluginfer import LLM, SamplingParams
    from pluginfer.engine.engine_core import EngineCore

    engine = LLM(model=gguf, max_num_seqs=4).engine
    prompt = engine.tokenizer.encode(PROMPT)
    params = SamplingParams(temperature=0.0, max_tokens=gen, ignore_eos=True)

    def run(count: int, frames: EngineCore | None = None) -> tuple[list[float], list[float]]:
        steps, step_cpu = [], []
        for i in range(count):
            engine.add_request([prompt[0] + i] + prompt[1:], params)
            first = True
            while engine.has_unfinished_requests():
                cpu, started = time.process_time(), time.perf_counter()
                outputs = engine.step()
                if frames is not None:  # the core's serving-only work: the step's frame, on the step's thread
                    cpu = time.thread_time()
                    frames._send_outputs(outputs)
                    step_cpu.append(time.thread_time() - cpu)
                elif not first:
                    steps.append(time.perf_counter() - started)
                    step_cpu.append(time.process_time() - cpu)
                first = False
        return steps, step_cpu

    run(1)  # warm-up
    cpu = time.process_time()
    steps, step_cpu = run(requests)
    total = time.process_time() - cpu
    # The engine core's frame per step (deltas, pickle, the socket write), read off a socket pair by a thread.
    ours, theirs = socket.socketpair()

    def drain() -> None:
        while theirs.recv(1 << 20):
            pass

    threading.Thread(target=drain, daemon=True).start()
    frames = EngineCore(None, ours)
    frames.engine = engine
    _, frame_cpu = run(requests, frames)
    return {"cpu_ms_per_token": total / (requests * gen) * 1e3, "cpu_ms_per_step": sum(step_cpu) / len(step_cpu) * 1e3,
            "step_ms": statistics.median(steps) * 1e3, "frame_us": statistics.median(frame_cpu) * 1e6}


# -- the client (a child: `--client URL REQUESTS GEN KIND`; measures after a "go" line on stdin) ---------


async def client(url: str, requests: int, gen: int, kind: str) -> None:
    import openai

    async def one(api: openai.AsyncOpenAI, i: int) -> tuple[list[float], int]:
        if kind == "raw":
            _, stamps, tokens = await stream_one_raw(url, i, gen)
        else:
            _, stamps, tokens = await stream_one(api, i, gen)
        return stamps, tokens

    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600) as api:
        await one(api, -1)  # warm-up
        print("warm", flush=True)
        sys.stdin.readline()
        cpu = time.process_time()
        results = [await one(api, i) for i in range(requests)]
        cpu = time.process_time() - cpu
    gaps = [b - a for stamps, _ in results for a, b in zip(stamps, stamps[1:])]
    print(json.dumps({"tokens": sum(tokens for _, tokens in results), "client_cpu_s": cpu,
                      "itl_ms": statistics.median(gaps) * 1e3}), flush=True)


def serve_round(server: Server, args: argparse.Namespace) -> dict[str, float]:
    process = subprocess.Popen([sys.executable, __file__, "--client", server.url, str(args.requests), str(args.gen),
                                args.client_kind], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    if process.stdout.readline().strip() != "warm":
        raise RuntimeError("the client did not start")
    pid = server.process.pid
    (own, system), tree = process_cpu_seconds(pid), run_seconds(pid, descendants=True)
    process.stdin.write("go\n")
    process.stdin.flush()
    result = json.loads(process.stdout.readline())
    after, tree = process_cpu_seconds(pid), run_seconds(pid, descendants=True) - tree
    own, system = after[0] - own, after[1] - system
    process.wait(30)
    tokens = result["tokens"]
    return {"server_cpu_ms": own / tokens * 1e3, "server_sys_ms": system / tokens * 1e3, "core_cpu_ms": (tree - own) / tokens * 1e3,
            "client_cpu_ms": result["client_cpu_s"] / tokens * 1e3, "itl_ms": result["itl_ms"]}


def start(spec: str, gguf: Path, work: Path) -> Server:
    """``process`` or ``llamacpp``, optionally with environment variables: ``process:PYTHONPATH=/tmp/old``."""
    variant, _, extra = spec.partition(":")
    env = dict(os.environ, **dict(item.split("=", 1) for item in extra.split(",") if item))
    log = work / f"token-cpu-{re.sub(r'[^A-Za-z0-9_.]+', '-', spec)}.log"
    port = free_port()
    if variant == "llamacpp":
        command = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--model_alias", "m",
                   "--port", str(port), "--n_ctx", "2048", "--n_threads", str(os.cpu_count() or 1),
                   "--n_batch", "512", "--interrupt_requests", "False"]
        return Server(spec, command, env, port, log, "/v1/models")
    command = [sys.executable, "-m", "pluginfer", "serve", "--model", str(gguf), "--port", str(port),
               "--served-model-name", "m", "--max-num-seqs", "4"]
    return Server(spec, command, dict(env, PLUGINFER_ENGINE_PROCESS="1"), port, log)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", type=Path, default=Path("/tmp/pluginfer-serve-bench/smol135m-q4_1.gguf"),
                        help="a GGUF file (serve_vs_llamacpp.py builds this one)")
    parser.add_argument("--variants", nargs="+", default=["process"],
                        help="process and/or llamacpp, each optionally with environment variables for it "
                             "(process:PYTHONPATH=/tmp/old-checkout runs an older checkout's server)")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--gen", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--work-dir", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "pluginfer-serve-bench")
    parser.add_argument("--no-offline", action="store_true", help="servers only")
    parser.add_argument("--client-kind", choices=["openai", "raw"], default="openai",
                        help="the openai package, or serve_client.py's minimal client (stream_one_raw)")
    parser.add_argument("--client", nargs=4, help=argparse.SUPPRESS)
    parser.add_argument("--offline", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        asyncio.run(client(args.client[0], int(args.client[1]), int(args.client[2]), args.client[3]))
        return 0
    if args.offline:
        print(json.dumps(offline(args.offline, args.requests, args.gen)))
        return 0
    args.work_dir.mkdir(parents=True, exist_ok=True)
    rows: dict[str, list[dict[str, float]]] = {}
    servers = []  # all started at once and measured in turn each round: the machine's load drifts alike for all
    try:
        for spec in args.variants:
            servers.append(start(spec, args.gguf, args.work_dir))
        for round_index in range(args.rounds):
            print(f"round {round_index + 1}: load average {load_average():.2f}", flush=True)
            if not args.no_offline:
                out = subprocess.run([sys.executable, __file__, "--offline", str(args.gguf), "--requests",
                                      str(args.requests), "--gen", str(args.gen)], capture_output=True, text=True,
                                     check=True)
                result = json.loads(out.stdout.strip().splitlines()[-1])
                rows.setdefault("offline", []).append(result)
                print(f"  offline: cpu {result['cpu_ms_per_token']:.2f} ms/token ({result['cpu_ms_per_step']:.2f} per "
                      f"decode step), step {result['step_ms']:.2f} ms; the core's frame {result['frame_us']:.0f} us CPU",
                      flush=True)
            for server in servers:
                result = serve_round(server, args)
                rows.setdefault(server.name, []).append(result)
                print(f"  {server.name}: cpu ms/token: server {result['server_cpu_ms']:.3f} (kernel "
                      f"{result['server_sys_ms']:.3f}), core {result['core_cpu_ms']:.2f}, client "
                      f"{result['client_cpu_ms']:.3f}; itl {result['itl_ms']:.2f} ms", flush=True)
    finally:
        for server in servers:
            server.stop()
    print(f"\nmedians of {args.rounds} rounds, {args.requests} requests x {args.gen} tokens, concurrency 1 "
          f"(load average now {load_average():.2f}):")
    for name, results in rows.items():
        medians = {key: statistics.median(r[key] for r in results) for key in results[0]}
        print(f"{name:>9}: " + ", ".join(f"{key} {value:.3f}" for key, value in medians.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
