"""Load time to first token, resident memory and batch-1 decode of one GGUF file: pluginfer and llama.cpp.

    python benchmarks/gguf_footprint.py FILE.gguf [FILE.gguf ...] --runs 3 [--threads 2] [--llama-cpp]
    python benchmarks/gguf_footprint.py FILE.gguf --source before=/tmp/old-checkout --source after=.  # A/B

Every measurement runs in a fresh process (so memory and load time start from nothing; the file is in the
page cache after the first run), runs interleaved over engines and files, medians reported:
- load to first token: from the process's start (imports included) to the first generated token of a
  one-token prompt (pluginfer: ``LLM(...)`` then ``generate``; llama.cpp: ``Llama(...)`` then one decode);
- resident memory after that first token (VmRSS) and the peak (VmHWM), in MB; the file's mapped pages
  count where they were read (both engines map the file);
- batch-1 decode tokens/s: prompt 128, 64 greedy tokens, prefill excluded (pluginfer: the 64-token run
  minus the 1-token run, as benchmarks/vs_llamacpp.py does), by the wall clock and per second of the
  process's CPU time (all its threads): on a shared machine the second is the steadier one.
Both engines get a 1,024-token context (pluginfer: ``max_model_len`` 1024, one sequence).
Build the 0.5B-shaped files with benchmarks/vs_llamacpp.py --work-dir DIR (Q4_K_M by llama.cpp's quantizer).
"""

from __future__ import annotations

import time

STARTED = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

CONTEXT, PROMPT, NEW_TOKENS = 1024, 128, 64


def memory_mb() -> tuple[float, float]:
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return (int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024)


def measure_pluginfer(path: str, threads: int, eager: bool = False) -> dict:
    import torch

    torch.set_num_threads(threads)
    from pluginfer import LLM, SamplingParams

    llm = LLM(model=path, max_model_len=CONTEXT, max_num_seqs=1, enable_prefix_caching=False, enforce_eager=eager)
    llm.generate([[10]], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    first_token = time.perf_counter() - STARTED
    rss, peak = memory_mb()
    prompt = [10 + (i * 7919) % 20000 for i in range(PROMPT)]

    def run(tokens: int) -> tuple[float, float]:
        start, cpu = time.perf_counter(), time.process_time()
        llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True))
        return time.perf_counter() - start, time.process_time() - cpu

    one, many = run(1), run(NEW_TOKENS)
    return {"first_token_s": first_token, "rss_mb": rss, "peak_mb": peak,
            "decode_tok_s": (NEW_TOKENS - 1) / (many[0] - one[0]),
            "decode_tok_cpu_s": (NEW_TOKENS - 1) / (many[1] - one[1]), "peak_after_decode_mb": memory_mb()[1]}


def measure_llama_cpp(path: str, threads: int) -> dict:
    import llama_cpp

    model = llama_cpp.Llama(model_path=path, n_ctx=CONTEXT, n_batch=512, n_threads=threads, verbose=False)
    model.eval([10])
    first_token = time.perf_counter() - STARTED
    rss, peak = memory_mb()
    prompt = [10 + (i * 7919) % 20000 for i in range(PROMPT)]
    model.reset()
    model.eval(prompt)
    start, cpu = time.perf_counter(), time.process_time()
    token = int(model.scores[model.n_tokens - 1].argmax())
    for _ in range(NEW_TOKENS - 1):
        model.eval([token])
        token = int(model.scores[model.n_tokens - 1].argmax())
    return {"first_token_s": first_token, "rss_mb": rss, "peak_mb": peak,
            "decode_tok_s": (NEW_TOKENS - 1) / (time.perf_counter() - start),
            "decode_tok_cpu_s": (NEW_TOKENS - 1) / (time.process_time() - cpu), "peak_after_decode_mb": memory_mb()[1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--llama-cpp", action="store_true", help="measure llama.cpp on the same files too")
    parser.add_argument("--source", action="append", default=[], metavar="NAME=PATH",
                        help="a pluginfer checkout to measure (imported from PATH), interleaved with the others; "
                             "default: the installed pluginfer")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="pluginfer without its recorded decode steps (the engine's --enforce-eager)")
    parser.add_argument("--child", choices=["pluginfer", "llama.cpp"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        if args.child == "pluginfer":
            print(json.dumps(measure_pluginfer(args.files[0], args.threads, args.enforce_eager)))
        else:
            print(json.dumps(measure_llama_cpp(args.files[0], args.threads)))
        return
    sources = dict(item.split("=", 1) for item in args.source) or {"pluginfer": None}
    engines = [(name, "pluginfer", path) for name, path in sources.items()]
    engines += [("llama.cpp", "llama.cpp", None)] if args.llama_cpp else []
    results: dict[tuple[str, str], list[dict]] = {}
    for _ in range(args.runs):
        for path in args.files:
            for name, kind, source in engines:
                env = dict(os.environ)
                if source:
                    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(source).resolve()),
                                                                      env.get("PYTHONPATH")]))
                command = [sys.executable, __file__, path, "--child", kind, "--threads", str(args.threads)]
                out = subprocess.run(command + (["--enforce-eager"] if args.enforce_eager else []),
                                     env=env, capture_output=True, text=True, check=True, cwd=source or None)
                results.setdefault((path, name), []).append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"{args.threads} threads, medians of {args.runs} runs (fresh process each)")
    print("file                          engine      first token s  RSS MB  peak MB  decode b1 tok/s  "
          "tok per CPU-s")
    for (path, engine), runs in results.items():
        median = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
        print(f"{Path(path).name:29s} {engine:10s} {median['first_token_s']:13.2f} {median['rss_mb']:7.0f} "
              f"{median['peak_after_decode_mb']:8.0f} {median['decode_tok_s']:16.1f} {median['decode_tok_cpu_s']:14.1f}",
              flush=True)


if __name__ == "__main__":
    main()
