"""Batch-1 decode step time at a given thread count, source trees side by side (wall clock and CPU time).

    python benchmarks/decode_step_threads.py --models /tmp/wf/model-q4_k_m.gguf --threads 1 2 \\
        --trees before=/tmp/before after=.

Each measurement is a fresh process (the tree first on ``PYTHONPATH``, ``torch.set_num_threads(threads)``): a
prompt of 32 tokens, then ``--tokens`` greedy tokens; per step = (t(N + 1 tokens) - t(1 token)) / N, in wall
clock and in the process's CPU time (all its threads: a spinning OpenMP thread counts). Runs are interleaved
(every round visits every model, thread count and tree); medians over ``--runs`` and the ratio of two trees.
On a shared machine the 2-thread wall clock is only worth something in a quiet stretch; the load average is
printed with each round.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def measure(model: str, threads: int, tokens: int) -> dict[str, float]:
    import torch

    torch.set_num_threads(threads)
    from pluginfer import LLM, SamplingParams

    extra = {} if model.endswith(".gguf") else {"dtype": "float32"}
    llm = LLM(model=model, max_model_len=1024, max_num_seqs=16, enable_prefix_caching=False,
              max_num_batched_tokens=2048, **extra)
    prompt = [list(range(100, 132))]

    def run(new_tokens: int) -> tuple[float, float]:
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        wall, cpu = time.perf_counter(), time.process_time()
        llm.generate(prompt, params)
        return time.perf_counter() - wall, time.process_time() - cpu

    run(8)  # warm-up: first-call paths, the recording of the decode step
    full, first = run(tokens + 1), run(1)
    llm.close()
    return {"wall": (full[0] - first[0]) / tokens * 1e3, "cpu": (full[1] - first[1]) / tokens * 1e3}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=[])
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--trees", nargs="+", default=["."], help="NAME=PATH or PATH, each first on PYTHONPATH")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--one", nargs=3, metavar=("MODEL", "THREADS", "TOKENS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one[0], int(args.one[1]), int(args.one[2]))))
        return 0
    trees = [tree.split("=", 1) if "=" in tree else (Path(tree).resolve().name, tree) for tree in args.trees]
    samples: dict[tuple[str, int, str], list[dict[str, float]]] = {}
    for round_ in range(args.runs):
        print(f"round {round_ + 1}: load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
        for model in args.models:
            for threads in args.threads:
                for name, path in trees:
                    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(path).resolve()),
                                                                       os.environ.get("PYTHONPATH", "")]))
                    done = subprocess.run([sys.executable, __file__, "--one", model, str(threads), str(args.tokens)],
                                          env=env, check=True, capture_output=True, text=True)
                    samples.setdefault((model, threads, name), []).append(
                        json.loads(done.stdout.strip().splitlines()[-1]))
    print(f"ms per batch-1 decode step, medians of {args.runs} runs ({args.tokens} steps each): wall / CPU")
    for model in args.models:
        for threads in args.threads:
            medians = {}
            for name, _ in trees:
                runs = samples[(model, threads, name)]
                medians[name] = {key: statistics.median(run[key] for run in runs) for key in ("wall", "cpu")}
                walls = sorted(run["wall"] for run in runs)
                print(f"{Path(model).name:28s} {threads} thr {name:10s} {medians[name]['wall']:8.3f} "
                      f"{medians[name]['cpu']:8.3f}   (wall min {walls[0]:.3f})")
            if len(trees) == 2:
                (a, _), (b, _) = trees
                print(f"{Path(model).name:28s} {threads} thr {b + '/' + a:10s} "
                      f"{medians[b]['wall'] / medians[a]['wall']:7.3f}x {medians[b]['cpu'] / medians[a]['cpu']:7.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
