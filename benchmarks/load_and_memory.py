"""Load to first token phase by phase, and resident memory: pluginfer (one or more source trees) and llama.cpp
on the same GGUF files, each run a fresh process.

    python benchmarks/load_and_memory.py FILE.gguf [FILE.gguf ...] --runs 5 [--threads 1] [--llama-cpp] \
        [--source before=/tmp/old-checkout --source after=.] [--bytecode DIR]

Runs are interleaved over files and engines (the file is in the page cache after the first); medians. Each
child times (wall and its own CPU) ``import torch``, ``from pluginfer import LLM``, ``LLM(...)`` (with the
engine's ``startup_times``) and a one-token ``generate`` (llama.cpp: ``import llama_cpp``, ``Llama(...)``, one
``eval``), then records its resident memory (VmRSS) and, after 64 greedy tokens of a 128-token prompt, its peak
(VmHWM). ``python -c "import torch"`` runs alongside as the bound any engine that imports torch pays. Both
engines get a 1,024-token context. ``--bytecode DIR``: children cache compiled modules under DIR, as an
installed package would."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

CONTEXT = 1024

# Both children: mark(name) records the wall and CPU seconds since the previous mark.
CHILD_MARKS = r"""
import time
T0, C0 = time.perf_counter(), time.process_time()
marks = {}
def mark(name, since=[0.0, 0.0]):
    wall, cpu = time.perf_counter() - T0, time.process_time() - C0
    marks[name] = (wall - since[0], cpu - since[1]); since[:] = [wall, cpu]
def memory_mb():
    fields = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
    return {"rss_mb": int(fields["VmRSS"].split()[0]) / 1024, "peak_mb": int(fields["VmHWM"].split()[0]) / 1024}
PROMPT = [10 + (i * 7919) % 20000 for i in range(128)]
"""

CHILD_PLUGINFER = CHILD_MARKS + r"""
import sys, json
import torch; mark("import torch")
torch.set_num_threads(THREADS)
from pluginfer import LLM, SamplingParams; mark("import pluginfer")
llm = LLM(model=PATH, max_model_len=CONTEXT, max_num_seqs=1, enable_prefix_caching=False); mark("LLM()")
llm.generate([[10]], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)); mark("first token")
marks["total"] = (time.perf_counter() - T0, time.process_time() - C0)
memory = {"first token": memory_mb()}
llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True))
memory["64 tokens"] = memory_mb()
phases = dict(llm.engine.startup_times)
print(json.dumps({"marks": marks, "startup": phases, "memory": memory}))
"""

CHILD_LLAMA = CHILD_MARKS + r"""
import json
import llama_cpp; mark("import llama_cpp")
model = llama_cpp.Llama(model_path=PATH, n_ctx=CONTEXT, n_batch=512, n_threads=THREADS, verbose=False); mark("Llama()")
model.eval([10]); mark("first token")
marks["total"] = (time.perf_counter() - T0, time.process_time() - C0)
memory = {"first token": memory_mb()}
model.reset()
model.eval(PROMPT)
for _ in range(63):
    model.eval([int(model.scores[model.n_tokens - 1].argmax())])
memory["64 tokens"] = memory_mb()
print(json.dumps({"marks": marks, "startup": {}, "memory": memory}))
"""

CHILD_TORCH = r"""
import time
T0, C0 = time.perf_counter(), time.process_time()
import json, torch
print(json.dumps({"marks": {"import torch": (time.perf_counter() - T0, time.process_time() - C0),
                            "total": (time.perf_counter() - T0, time.process_time() - C0)}, "startup": {},
                  "memory": {"import torch": {"rss_mb": int(dict(line.split(":", 1) for line in open("/proc/self/status")
                                                                  if ":" in line)["VmRSS"].split()[0]) / 1024}}}))
"""


def run_child(code: str, env: dict, cwd: str | None) -> dict:
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=cwd, capture_output=True, text=True)
    process = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"a child failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["marks"]["process"] = (process, float("nan"))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--llama-cpp", action="store_true")
    parser.add_argument("--source", action="append", default=[], metavar="NAME=PATH",
                        help="a pluginfer tree to import (PYTHONPATH); repeat for A/B runs")
    parser.add_argument("--bytecode", metavar="DIR", help="children cache compiled modules under DIR")
    args = parser.parse_args()
    for file in args.files:
        if not Path(file).is_file():
            parser.error(f"no such GGUF file: {file}")
    sources = dict(item.split("=", 1) for item in args.source) or {"pluginfer": None}
    base_env = dict(os.environ)
    if args.bytecode:
        base_env.pop("PYTHONDONTWRITEBYTECODE", None)
        base_env["PYTHONPYCACHEPREFIX"] = str(Path(args.bytecode).resolve())
    engines = [(name, "pluginfer", source) for name, source in sources.items()]
    if args.llama_cpp:
        engines.append(("llama.cpp", "llama.cpp", None))
    results: dict[tuple[str, str], list[dict]] = {}
    for run in range(args.runs):
        env = dict(base_env)
        results.setdefault(("import torch", "-"), []).append(run_child(CHILD_TORCH, env, None))
        for file in args.files:
            for name, kind, source in engines:
                env = dict(base_env)
                if source:
                    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(source).resolve()),
                                                                      env.get("PYTHONPATH")]))
                template = CHILD_PLUGINFER if kind == "pluginfer" else CHILD_LLAMA
                code = (template.replace("PATH", repr(str(Path(file).resolve())))
                        .replace("THREADS", str(args.threads)).replace("CONTEXT", str(CONTEXT)))
                results.setdefault((Path(file).name, name), []).append(
                    run_child(code, env, str(Path(source).resolve()) if source else None))
        print(f"run {run + 1}/{args.runs} done", file=sys.stderr)
    for (file, name), runs in results.items():
        print(f"\n{file} / {name} (median of {len(runs)}; wall s / CPU s)")
        for phase in runs[0]["marks"]:
            wall = statistics.median(r["marks"][phase][0] for r in runs)
            cpu = statistics.median(r["marks"][phase][1] for r in runs)
            print(f"  {phase:18s} {wall:7.3f} / {cpu:7.3f}")
        for phase in runs[0]["startup"]:
            print(f"    LLM(): {phase:10s} {statistics.median(r['startup'][phase] for r in runs):7.3f} (wall)")
        for when, figures in runs[0]["memory"].items():
            print(f"  memory at {when}: " + ", ".join(
                f"{name} {statistics.median(r['memory'][when][name] for r in runs):.0f} MB" for name in figures))


if __name__ == "__main__":
    main()
