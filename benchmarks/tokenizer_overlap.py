"""A GGUF file's tokenizer built after the weights load (as before) or in a thread beside it (``TokenizerBuild``,
as ``LLMEngine`` does since issue 18's start-up work), interleaved in one process, medians.

    python benchmarks/tokenizer_overlap.py FILE.gguf [FILE.gguf ...] --runs 7 [--threads 2]

Each run builds the executor (config, build, load, repack, cache) and the tokenizer both ways, in turn; the
first run of each way is dropped (imports, first touches). Wall clock and the process's CPU time (all its
threads) of the pair; CPU stays about the same, the wall clock is what the thread can take off.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time


def timed(build) -> tuple[float, float]:
    gc.collect()
    wall, cpu = time.perf_counter(), time.process_time()
    build()
    return time.perf_counter() - wall, time.process_time() - cpu


def compare(file: str, runs: int) -> dict[str, list[tuple[float, float]]]:
    """Both ways, in turn, ``runs`` + 1 times; the first of each dropped."""
    from pluginfer.core.config import build_config
    from pluginfer.engine.executor import Executor
    from pluginfer.text.tokenizer import TokenizerBuild, load_tokenizer

    config = build_config(model=file, max_model_len=1024, **{"scheduler.max_num_seqs": 1})
    kept = []

    def after() -> None:
        executor = Executor(config)
        kept.append((executor, load_tokenizer(file)))

    def beside() -> None:
        building = TokenizerBuild(file)
        executor = Executor(config)
        kept.append((executor, building.result()))

    results: dict[str, list[tuple[float, float]]] = {"after": [], "beside": []}
    for run in range(runs + 1):
        for name, build in (("after", after), ("beside", beside)):
            measured = timed(build)
            for executor, _ in kept:
                executor.shutdown()
            kept.clear()
            if run:
                results[name].append(measured)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("files", nargs="+")
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    for file in args.files:
        results = compare(file, args.runs)
        print(f"{file} ({args.threads} threads, median of {args.runs}): wall s / CPU s")
        for name, runs in results.items():
            wall = statistics.median(r[0] for r in runs)
            cpu = statistics.median(r[1] for r in runs)
            print(f"  tokenizer {name:6s} the weights' load: {wall:.3f} / {cpu:.3f}")
        ratio = statistics.median(b[0] / a[0] for a, b in zip(results["after"], results["beside"]))
        print(f"  beside / after, wall (median of the runs' ratios): {ratio:.2f}x")


if __name__ == "__main__":
    main()
