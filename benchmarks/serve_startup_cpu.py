"""Where `pluginfer serve`'s start-up goes, in CPU time (a loaded machine stretches wall-clock phases, not these).

    python benchmarks/serve_startup_cpu.py --gguf /tmp/pluginfer-serve-bench/smol135m-q4_1.gguf --runs 5

Each run, in fresh interpreters (medians of ``--runs``):
- `python -c pass`: the interpreter's own start and exit;
- the server's part before it spawns the engine core: `pluginfer serve`'s parser and config (cli/serve.py);
- `import torch` alone;
- the engine core's steps as `engine/engine_core.py` takes them (config import, torch, the engine's modules,
  `LLMEngine`, the warm-up request), each by the process's CPU clock; `LLMEngine`'s own wall-clock phases
  (config, build, load, repack, cache, tokenizer) beside them.
A whole process's CPU (interpreter start and exit included) comes from getrusage of the child.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys

SERVER_BEFORE_SPAWN = """
from pluginfer.cli import build_parser
from pluginfer.cli.serve import serve_config
serve_config(build_parser().parse_args(['serve', '--model', {gguf!r}]))
"""

CORE = """
import json, time
marks = {{}}
last = time.process_time()
def mark(name):
    global last
    now = time.process_time()
    marks[name] = now - last
    last = now
from pluginfer.core.config import build_config
config = build_config(model={gguf!r}, **{{"scheduler.max_num_seqs": 16}})
mark("config (pydantic)")
import torch
mark("import torch")
from pluginfer.engine.engine import LLMEngine
from pluginfer.formats.gguf.tokenizer import GGUFTokenizer
from pluginfer.engine.sequence import SamplingParams
mark("engine modules")
engine = LLMEngine(config)
mark("LLMEngine")
engine.add_request(list(range(1, 9)), SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), request_id="w")
while engine.has_unfinished_requests():
    engine.step()
mark("warm-up")
marks.update({{"LLMEngine wall " + k: v for k, v in engine.startup_times.items()}})
print(json.dumps(marks))
"""


def child_cpu(code: str) -> tuple[float, str]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", required=True)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    samples: dict[str, list[float]] = {}
    for _ in range(args.runs):
        for name, code in (("process: python -c pass", "pass"),
                           ("process: server before the core is spawned", SERVER_BEFORE_SPAWN.format(gguf=args.gguf)),
                           ("process: import torch", "import torch")):
            samples.setdefault(name, []).append(child_cpu(code)[0])
        total, out = child_cpu(CORE.format(gguf=args.gguf))
        samples.setdefault("process: engine core to ready", []).append(total)
        for name, seconds in json.loads(out.strip().splitlines()[-1]).items():
            samples.setdefault("  core " + name, []).append(seconds)
    for name, values in samples.items():
        kind = "wall" if " wall " in name else "CPU"
        print(f"{name:<48} {statistics.median(values):6.3f} s {kind} ({min(values):.3f}-{max(values):.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
