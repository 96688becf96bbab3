"""Serving at the engine's speed: `pluginfer serve` (and llama.cpp's server) against the offline engine.

    python benchmarks/serve_vs_llamacpp.py                       # 135M-shaped llama, Q4_1 GGUF, c = 1, 4, 16
    python benchmarks/serve_vs_llamacpp.py --shape small13m      # a ~13M llama: a step of a few ms
    python benchmarks/serve_vs_llamacpp.py --variants process inprocess:PYTHONPATH=/tmp/old-checkout

A random llama of SmolLM2-135M's shape (30 layers, hidden 576, intermediate 1536, 9 heads / 3 KV heads,
vocabulary 49152, tied embeddings; our offline tokenizer padded to the vocabulary) is built locally and
written by `pluginfer convert --quant q4_1` (kept in --work-dir, reused). Tokens that are a lone byte of
a multi-byte character get zero embedding rows, so that every generated token is text a server streams
at once (with random weights they would otherwise be picked, and held back until the character ends).

Servers, each on the same file, started once and timed to their first ready answer (`/health` 200;
llama_cpp.server has no /health: `/v1/models` 200; `--startups N` only times N interleaved starts):
- `process`: `pluginfer serve` as shipped (the engine core in its own process);
- `inprocess`: `pluginfer serve` with PLUGINFER_ENGINE_PROCESS=0 (the step loop in a thread of the server);
- `llamacpp`: `python -m llama_cpp.server` when `llama_cpp` imports (else a note says it was skipped), with
  `--interrupt_requests False` (by default each new request cuts the running stream short); it serves one
  request at a time, so at concurrency > 1 the others queue;
a server whose process ends mid-run is reported (how it ended, its log; for llama.cpp's SIGSEGV, the AMX build
note) and left out of the rest of the run;
each optionally with environment variables (`process:OMP_WAIT_POLICY=ACTIVE`, or `inprocess:PYTHONPATH=DIR`
to run an older checkout) and `pluginfer serve` flags (`process:--core-spin-count=3000`).

One client for all: the official `openai` package (AsyncOpenAI), streaming `/v1/completions` with
128 generated tokens at temperature 0 (`ignore_eos`), at concurrency 1, 4 and 16, in its own process.
With `--one-at-a-time --clients openai raw` each server is also measured through a minimal client (HTTP/1.1
on an asyncio stream, `json.loads` per event: rows `SERVER+raw`): on 2 cores the client's own CPU per token
runs inside the next step, and the `openai` package's is about a tenth of a 4 ms step by itself.
Per run: median time to first token, median inter-token latency (gaps between a stream's chunks),
output tokens/s (tokens from the usage chunk over the wall time).

Beside them, the offline engine on the same file (`LLM`'s engine stepped directly in a child process,
same `max_num_seqs`; one per `--offline-env` entry, by default as is and with OMP_WAIT_POLICY=PASSIVE),
measured at batch = concurrency just before the servers in every round: its median decode step and its
decode tokens/s. The servers' ratios are to the round's fastest offline engine: ITL to its step (the
target: <= 1.1x at concurrency 1), tokens/s to its tokens/s (>= 0.9x at 16).

`--one-at-a-time` starts, measures and stops each engine and server alone in each round (an engine whose
idle OpenMP threads spin, OMP_WAIT_POLICY=ACTIVE, would otherwise take the cores from the others), and
measures each idle server's CPU use (server and engine core, /proc utime + stime) for `--idle-seconds`:

    python benchmarks/serve_vs_llamacpp.py --one-at-a-time --variants process process:OMP_WAIT_POLICY=ACTIVE \
        --offline-env OMP_WAIT_POLICY=PASSIVE OMP_WAIT_POLICY=ACTIVE

The machine is shared: the client, the server and anything else running compete for the same cores.
Rounds interleave engines and concurrencies; read the medians of the ratios, not one figure.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from serve_harness import PROMPT, Server, free_port, idle_cpu, load_average, run_client

SHAPES = {  # SmolLM2-135M's shape, and a ~13M llama whose step is a few ms (where per-token overheads show)
    "smol135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                     tie_word_embeddings=True),
    "small13m": dict(vocab_size=32000, hidden_size=256, intermediate_size=704, num_hidden_layers=6,
                     num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
                     tie_word_embeddings=True),
}


# -- the model ------------------------------------------------------------------------------------


def build_gguf(work: Path, quant: str, shape_name: str) -> Path:
    out = work / f"{shape_name}-{quant}.gguf"
    if out.exists():
        return out
    shape = SHAPES[shape_name]
    checkpoint = work / shape_name
    if not (checkpoint / "config.json").exists():
        import torch
        from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

        from pluginfer.demo.tokenizer import train_tokenizer

        train_tokenizer(checkpoint)
        tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
        tokenizer.add_tokens([f"<pad_{i}>" for i in range(shape["vocab_size"] - len(tokenizer))])
        tokenizer.save_pretrained(checkpoint)
        torch.manual_seed(0)
        config = LlamaConfig(**shape, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
        model = LlamaForCausalLM(config)
        # Random weights pick tokens at random; a lone byte of a multi-byte character is no text yet, and a
        # server streams nothing until the character completes. Zero rows (zero logits, never the argmax)
        # for such tokens so that every generated token is text, as with a trained model.
        partial = [i for i in range(len(tokenizer)) if "\ufffd" in tokenizer.decode([i])]
        with torch.no_grad():
            model.model.embed_tokens.weight[partial] = 0.0
        model.save_pretrained(checkpoint, safe_serialization=True)
    subprocess.run([sys.executable, "-m", "pluginfer", "convert", "--model", str(checkpoint), "--quant", quant,
                    "--output", str(out)], check=True)
    return out


# -- the offline engine (a child process: `--offline GGUF`, one measurement per line asked on stdin) ---


def offline(gguf: str, max_num_seqs: int, gen: int) -> None:
    """Answer each batch size read from stdin with {"step_ms": median decode step, "tok_s": decode
    tokens/s} of that many sequences generating ``gen`` tokens (prefill steps excluded)."""
    from pluginfer import LLM, SamplingParams

    llm = LLM(model=gguf, max_num_seqs=max_num_seqs)
    engine = llm.engine
    prompt = llm.get_tokenizer().encode(PROMPT)

    def decode(batch: int) -> dict[str, float]:
        for i in range(batch):
            engine.add_request([prompt[0] + i] + prompt[1:], SamplingParams(temperature=0.0, max_tokens=gen,
                                                                            ignore_eos=True))
        steps = []
        while engine.has_unfinished_requests():
            started = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - started)
        decode_steps = steps[1:]  # the first step reads the prompts
        return {"step_ms": statistics.median(decode_steps) * 1e3,
                "tok_s": batch * len(decode_steps) / sum(decode_steps)}

    decode(1)  # warm-up
    print("ready", flush=True)
    for line in sys.stdin:
        print(json.dumps(decode(int(line))), flush=True)


class Offline:
    def __init__(self, spec: str, gguf: Path, args: argparse.Namespace) -> None:
        self.name = "offline" + (f":{spec}" if spec else "")
        env = dict(os.environ, **dict(item.split("=", 1) for item in spec.split(",") if item))
        self.process = subprocess.Popen([sys.executable, __file__, "--offline", str(gguf), "--max-num-seqs",
                                         str(args.max_num_seqs), "--gen", str(args.gen)],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        while self.process.stdout.readline().strip() != "ready":
            if self.process.poll() is not None:
                raise RuntimeError("the offline engine did not start")

    def measure(self, batch: int) -> dict[str, float]:
        self.process.stdin.write(f"{batch}\n")
        self.process.stdin.flush()
        return json.loads(self.process.stdout.readline())

    def stop(self) -> None:
        self.process.stdin.close()
        self.process.wait(30)


# -- servers --------------------------------------------------------------------------------------


class ServerDied(RuntimeError):
    """A server's process ended while a client was being served (its rows are left out, the run goes on)."""


# llama-cpp-python 0.3.36's default build crashed on this project's AMX machines (docs/performance.md).
_LLAMACPP_CRASH_HINT = ("; llama-cpp-python's default build crashed with SIGSEGV on quantized files on CPUs "
                        "with AMX: rebuild it without AMX (docs/performance.md, 'Against llama.cpp on the same "
                        "GGUF files')")


def measure(server: Server, concurrency: int, requests: int, gen: int, kind: str = "openai") -> dict[str, float]:
    """``run_client`` against ``server``; ServerDied (how, and its log) when the server's process ended."""
    try:
        return run_client(server.url, concurrency, requests, gen, kind)
    except subprocess.CalledProcessError as exc:
        how = server.exit_description()
        if how is None:  # the server still runs: the client's own failure
            raise RuntimeError(f"the {kind} client failed against {server.name}, which still runs:\n"
                               f"{exc.stderr[-3000:]}") from None
        hint = _LLAMACPP_CRASH_HINT if server.name.startswith("llamacpp") and how == "exited on SIGSEGV" else ""
        raise ServerDied(f"{server.name} {how} while serving concurrency {concurrency} (its log: "
                         f"{server.log_path}){hint}") from None


def start_servers(args: argparse.Namespace, gguf: Path) -> Iterator[Server]:
    env = dict(os.environ)
    for spec in args.variants:
        variant, _, extra = spec.partition(":")  # e.g. process:OMP_WAIT_POLICY=ACTIVE,OTHER=1
        items = [item for item in extra.split(",") if item]
        flags = [item for item in items if item.startswith("--")]  # process:--core-spin-count=3000
        extra_env = dict(item.split("=", 1) for item in items if not item.startswith("--"))
        port = free_port()
        if variant == "llamacpp":
            try:
                import llama_cpp.server  # noqa: F401
            except ImportError as exc:
                print(f"note: llama_cpp.server is not importable ({exc}); its half is skipped "
                      "(pip install 'llama-cpp-python[server]' builds llama.cpp: ~15 min on 2 cores)", flush=True)
                continue
            # interrupt_requests off: by default a new request cuts the stream in progress short. It serves one
            # request at a time (a lock around the model), so concurrency queues there. It has no /health.
            command = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--model_alias", "m",
                       "--port", str(port), "--n_ctx", "2048", "--n_threads", str(os.cpu_count() or 1),
                       "--n_batch", "512", "--interrupt_requests", "False"]
            variant_env = dict(os.environ)
            ready_path = "/v1/models"
        else:
            command = [sys.executable, "-m", "pluginfer", "serve", "--model", str(gguf), "--port", str(port),
                       "--served-model-name", "m", "--max-num-seqs", str(args.max_num_seqs), *flags]
            variant_env = dict(env, PLUGINFER_ENGINE_PROCESS="0" if variant == "inprocess" else "1")
            ready_path = "/health"
        variant_env.update(extra_env)
        log = args.work_dir / f"server-{re.sub(r'[^A-Za-z0-9_.]+', '-', spec)}.log"
        server = Server(spec, command, variant_env, port, log, ready_path)
        print(f"{spec}: ready ({ready_path} 200) after {server.startup_s:.1f} s", flush=True)
        yield server


def time_startups(args: argparse.Namespace, gguf: Path) -> int:
    """Start each server, wait for its first ready answer, stop it; ``args.startups`` rounds, interleaved."""
    times: dict[str, list[float]] = {}
    for _ in range(args.startups):
        for server in start_servers(args, gguf):
            server.stop()
            times.setdefault(server.name, []).append(server.startup_s)
    print(f"\nstart-up to the first ready answer, median of {args.startups} (min-max):")
    for name, values in times.items():
        print(f"{name:>12}: {statistics.median(values):5.2f} s ({min(values):.2f}-{max(values):.2f})")
    return 0


def one_at_a_time(args: argparse.Namespace, gguf: Path) -> tuple[dict, dict, dict]:
    """Each round: every offline engine, then every server, each started, measured and stopped alone (an
    engine whose idle threads spin, OMP_WAIT_POLICY=ACTIVE, would otherwise take the cores from the others);
    after a server's runs, its idle CPU (server and core together) over ``--idle-seconds``."""
    samples: dict[tuple[str, int], list[dict[str, float]]] = {}
    idle: dict[str, list[float]] = {}
    startups: dict[str, list[float]] = {}
    variants = args.variants
    for round_index in range(args.rounds):
        print(f"round {round_index + 1}: load average {load_average():.2f}", flush=True)
        references: dict[int, list[dict[str, float]]] = {}
        for spec in [] if args.no_offline else args.offline_env:
            engine = Offline(spec, gguf, args)
            try:
                for concurrency in args.concurrency:
                    reference = engine.measure(concurrency)
                    references.setdefault(concurrency, []).append(reference)
                    samples.setdefault((engine.name, concurrency), []).append(
                        {"ttft_ms": float("nan"), "itl_ms": reference["step_ms"], "tok_s": reference["tok_s"]})
                    print(f"round {round_index + 1} {engine.name:>10} b={concurrency:<3} step "
                          f"{reference['step_ms']:7.2f} ms  {reference['tok_s']:7.1f} tok/s", flush=True)
            finally:
                engine.stop()
        for spec in variants:
            args.variants = [spec]
            for server in start_servers(args, gguf):
                try:
                    startups.setdefault(server.name, []).append(server.startup_s)
                    try:
                        measure_alone(args, server, references, samples, round_index)
                    except ServerDied as exc:
                        print(f"note: {exc}; its figures of this round are left out", flush=True)
                        continue
                    if args.idle_seconds:
                        cores = idle_cpu(server, args.idle_seconds)
                        idle.setdefault(server.name, []).append(cores)
                        print(f"round {round_index + 1} {server.name:>10} idle {cores:.3f} cores "
                              f"(load average {load_average():.2f})", flush=True)
                finally:
                    server.stop()
    args.variants = variants
    return samples, idle, startups


def measure_alone(args: argparse.Namespace, server: Server, references: dict[int, list[dict[str, float]]],
                  samples: dict[tuple[str, int], list[dict[str, float]]], round_index: int) -> None:
    """One round of ``server`` alone: every concurrency through every client, ratios to ``references``."""
    for concurrency in args.concurrency:
        for kind in args.clients:
            name = server.name if kind == "openai" else f"{server.name}+{kind}"
            result = measure(server, concurrency, max(args.requests, concurrency), args.gen, kind)
            if references.get(concurrency):
                result["itl_ratio"] = result["itl_ms"] / min(r["step_ms"] for r in references[concurrency])
                result["rate_ratio"] = result["tok_s"] / max(r["tok_s"] for r in references[concurrency])
            samples.setdefault((name, concurrency), []).append(result)
            print(f"round {round_index + 1} {name:>10} c={concurrency:<3} ttft {result['ttft_ms']:8.1f} ms  "
                  f"itl {result['itl_ms']:7.2f} ms  {result['tok_s']:7.1f} tok/s", flush=True)


def report(args: argparse.Namespace, gguf: Path, samples: dict[tuple[str, int], list[dict[str, float]]],
           idle: dict[str, list[float]], startups: dict[str, list[float]]) -> None:
    print(f"\nmedians of {args.rounds} rounds ({gguf.name}, {args.gen} tokens per request). Offline rows: batch = c, "
          "ITL column = its decode step. Ratios: to the round's fastest offline engine (ITL to its step, tokens/s "
          "to its tokens/s at batch = c)")
    width = max([10] + [len(name) for name, _ in samples])
    print(f"{'engine':>{width}} {'c':>3} {'TTFT ms':>9} {'ITL ms':>8} {'tok/s':>8} {'ITL/step':>9} {'tok/s ratio':>12}")
    for concurrency in args.concurrency:
        for name in dict.fromkeys(name for name, _ in samples):  # offline engines first, as measured
            runs = samples.get((name, concurrency))
            if not runs:
                continue
            values = [statistics.median(r.get(key, float("nan")) for r in runs)
                      for key in ("ttft_ms", "itl_ms", "tok_s", "itl_ratio", "rate_ratio")]
            print(f"{name:>{width}} {concurrency:>3} {values[0]:>9.1f} {values[1]:>8.2f} {values[2]:>8.1f} "
                  f"{values[3]:>8.2f}x {values[4]:>11.2f}x")
    for name, values in startups.items():
        print(f"{name}: ready after {statistics.median(values):.2f} s (median of {len(values)})", end="")
        if name in idle:
            print(f"; idle: {statistics.median(idle[name]):.3f} cores (median of {len(idle[name])}, "
                  f"{min(idle[name]):.3f}-{max(idle[name]):.3f})", end="")
        print()


# -- main -----------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", type=Path, help="a GGUF file (default: build the 135M-shaped one)")
    parser.add_argument("--quant", default="q4_1")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smol135m", help="the model to build")
    parser.add_argument("--work-dir", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "pluginfer-serve-bench")
    parser.add_argument("--variants", nargs="*", default=["process", "inprocess", "llamacpp"],
                        help="servers: process, inprocess, llamacpp, each optionally with environment variables "
                             "for it: process:OMP_WAIT_POLICY=ACTIVE")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--gen", type=int, default=128, help="tokens per request")
    parser.add_argument("--requests", type=int, default=16, help="requests per run (at least the concurrency)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--no-offline", action="store_true")
    parser.add_argument("--offline-env", nargs="+", default=["", "OMP_WAIT_POLICY=PASSIVE"],
                        help="one offline engine per entry, with these environment variables ('' = as is)")
    parser.add_argument("--startups", type=int, default=0, metavar="N",
                        help="only time start-up: start and stop each server N times, interleaved; medians")
    parser.add_argument("--one-at-a-time", action="store_true",
                        help="start, measure and stop each engine and server alone in each round (for engines whose "
                             "idle threads spin); with --idle-seconds, the idle server's CPU use")
    parser.add_argument("--idle-seconds", type=float, default=10.0,
                        help="with --one-at-a-time: how long to measure each server's idle CPU (0: not at all)")
    parser.add_argument("--clients", nargs="+", choices=["openai", "raw"], default=["openai"],
                        help="with --one-at-a-time: the clients to measure each server with, in turn: the openai "
                             "package, and/or a minimal HTTP client (rows named SERVER+raw)")
    parser.add_argument("--offline", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.offline:
        offline(args.offline, args.max_num_seqs, args.gen)
        return 0

    args.work_dir.mkdir(parents=True, exist_ok=True)
    gguf = args.gguf or build_gguf(args.work_dir, args.quant, args.shape)
    print(f"model: {gguf} ({gguf.stat().st_size / 2**20:.1f} MiB); {os.cpu_count()} cores; "
          f"{args.gen} tokens per request, {args.rounds} rounds", flush=True)
    if args.startups:
        return time_startups(args, gguf)
    if args.one_at_a_time:
        samples, idle, startups = one_at_a_time(args, gguf)
        report(args, gguf, samples, idle, startups)
        return 0
    offline_engines = [Offline(spec, gguf, args) for spec in args.offline_env] if not args.no_offline else []
    servers: list[Server] = []
    samples: dict[tuple[str, int], list[dict[str, float]]] = {}
    try:
        servers += start_servers(args, gguf)
        for round_index in range(args.rounds):
            for concurrency in args.concurrency:
                # The offline engine beside each concurrency (batch = concurrency); the servers' ratios are to
                # the fastest offline figure of the round: ITL to its decode step, tokens/s to its tokens/s.
                references = []
                for engine in offline_engines:
                    reference = engine.measure(concurrency)
                    references.append(reference)
                    samples.setdefault((engine.name, concurrency), []).append(
                        {"ttft_ms": float("nan"), "itl_ms": reference["step_ms"], "tok_s": reference["tok_s"]})
                    print(f"round {round_index + 1} {engine.name:>10} b={concurrency:<3} step "
                          f"{reference['step_ms']:7.2f} ms  {reference['tok_s']:7.1f} tok/s", flush=True)
                best_step = min((r["step_ms"] for r in references), default=None)
                best_rate = max((r["tok_s"] for r in references), default=None)
                for server in list(servers):
                    try:
                        result = measure(server, concurrency, max(args.requests, concurrency), args.gen)
                    except ServerDied as exc:
                        print(f"note: {exc}; its figures are left out from here on", flush=True)
                        servers.remove(server)
                        server.stop()
                        continue
                    if references:
                        result["itl_ratio"] = result["itl_ms"] / best_step
                        result["rate_ratio"] = result["tok_s"] / best_rate
                    samples.setdefault((server.name, concurrency), []).append(result)
                    print(f"round {round_index + 1} {server.name:>10} c={concurrency:<3} ttft {result['ttft_ms']:8.1f} ms"
                          f"  itl {result['itl_ms']:7.2f} ms  {result['tok_s']:7.1f} tok/s", flush=True)
    finally:
        for server in servers:
            server.stop()
        for engine in offline_engines:
            engine.stop()

    report(args, gguf, samples, {}, {server.name: [server.startup_s] for server in servers})
    return 0


if __name__ == "__main__":
    sys.exit(main())
