"""The fixed cost of one decode step: a tiny llama at batch 1, where the weights are too small to matter.

    python benchmarks/step_overhead.py                         # this checkout, float32 + GGUF Q4_0 / Q4_K_M
    python benchmarks/step_overhead.py --trees before=/tmp/old .  # two source trees, runs interleaved

A random llama of 13.6M parameters (4 layers, hidden 256, intermediate 768, 4 heads, 2 KV heads, vocab
20480; our offline tokenizer, padded) is built once in ``--work-dir`` and written as GGUF files (Q4_0 by
``pluginfer convert``, Q4_K_M by llama.cpp's quantizer from the F16 file, as ``vs_llamacpp.py`` does).
Each measurement runs in a fresh process with one torch thread and reads the process's CPU time, so
that other work on a shared machine inflates it far less than wall-clock time: a prompt of 32 tokens,
then ``--tokens`` greedy tokens; per step = (t(N + 1 tokens) - t(1 token)) / N. The step is split
into the model's layers (``pipeline.forward``, or the replay of a recorded decode step), the LM head (``compute_logits``) and the rest (the
scheduler, the step's metadata, the sampler, detokenization and stop checks), by timing those calls. Since the
replay records the LM head after the layers (where it can), a replayed step's head counts in "layers".
With ``--trees`` every run alternates between the trees (each is put first on ``PYTHONPATH``) and
the medians are reported with the ratio.
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

SHAPE = dict(layers=4, hidden=256, intermediate=768, heads=4, kv_heads=2, vocab=20480)
PARTS = ("step", "layers", "lm_head", "rest")


def build(work: Path) -> dict[str, Path]:
    sys.path.insert(0, str(Path(__file__).parent))
    from offline_throughput import build_checkpoint
    from vs_llamacpp import write_files

    args = argparse.Namespace(arch="llama", experts=0, top_k=0, **SHAPE)
    if not (work / "hf" / "config.json").exists():
        build_checkpoint(work / "hf", args)
    files = write_files(work / "hf", work, ["q4_0", "q4_k_m"])
    return {"float32": work / "hf", "Q4_0": files["q4_0"], "Q4_K_M": files["q4_k_m"]}


def measure(model: str, tokens: int) -> dict[str, float]:
    """One run in this process: milliseconds of CPU time per decode step, whole and by part."""
    import torch

    torch.set_num_threads(1)
    from pluginfer import LLM, SamplingParams

    extra = {} if model.endswith(".gguf") else {"dtype": "float32"}
    llm = LLM(model=model, max_model_len=1024, max_num_seqs=16, enable_prefix_caching=False,
              max_num_batched_tokens=2048, **extra)
    worker = llm.engine.executor.worker
    spent = {"layers": 0.0, "lm_head": 0.0}

    def timed(owner: object, method: str, part: str) -> None:  # the benchmark's own wrapper, nothing else sees it
        original = getattr(owner, method)

        def call(*args: object, **kwargs: object) -> object:
            started = time.process_time()
            try:
                return original(*args, **kwargs)
            finally:
                spent[part] += time.process_time() - started

        setattr(owner, method, call)

    timed(worker.pipeline, "forward", "layers")
    if worker.decode_graphs is not None:  # decode steps replayed (cpu_step_replay) are the layers' time too
        timed(worker, "decode_graphs", "layers")
    timed(worker.pipeline, "compute_logits", "lm_head")
    prompt = [list(range(100, 132))]

    def run(new_tokens: int) -> tuple[float, dict[str, float]]:
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        for part in spent:
            spent[part] = 0.0
        started = time.process_time()
        llm.generate(prompt, params)
        return time.process_time() - started, dict(spent)

    run(8)  # warm-up: first-call paths, kernel loading
    full, full_parts = run(tokens + 1)
    first, first_parts = run(1)
    per_step = {"step": (full - first) / tokens * 1e3}
    for part in spent:
        per_step[part] = (full_parts[part] - first_parts[part]) / tokens * 1e3
    per_step["rest"] = per_step["step"] - per_step["layers"] - per_step["lm_head"]
    llm.close()
    return per_step


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/pluginfer-step-overhead"))
    parser.add_argument("--trees", nargs="+", default=["."],
                        help="source trees to compare, as NAME=PATH or PATH (each first on PYTHONPATH)")
    parser.add_argument("--formats", nargs="+", default=["float32", "Q4_0", "Q4_K_M"])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--one", nargs=2, metavar=("MODEL", "TOKENS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one[0], int(args.one[1]))))
        return 0

    args.work_dir.mkdir(parents=True, exist_ok=True)
    models = build(args.work_dir)
    trees = [tree.split("=", 1) if "=" in tree else (Path(tree).resolve().name, tree) for tree in args.trees]
    samples: dict[tuple[str, str], list[dict[str, float]]] = {}
    for _ in range(args.runs):
        for fmt in args.formats:
            for name, path in trees:  # interleaved: every run visits every tree
                env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(path).resolve()),
                                                                   os.environ.get("PYTHONPATH", "")]))
                done = subprocess.run([sys.executable, __file__, "--one", str(models[fmt]), str(args.tokens)],
                                      env=env, check=True, capture_output=True, text=True)
                samples.setdefault((fmt, name), []).append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(f"ms of CPU time per batch-1 decode step, one torch thread, medians of {args.runs} runs "
          f"({args.tokens} steps each)")
    print(f"{'format':8s} {'tree':12s}" + "".join(f"{part:>10s}" for part in PARTS))
    for fmt in args.formats:
        medians = {}
        for name, _ in trees:
            runs = samples[(fmt, name)]
            medians[name] = {part: statistics.median(run[part] for run in runs) for part in PARTS}
            print(f"{fmt:8s} {name:12s}" + "".join(f"{medians[name][part]:10.3f}" for part in PARTS))
        if len(trees) == 2:
            (a, _), (b, _) = trees
            print(f"{fmt:8s} {b + '/' + a:12s}" + "".join(
                f"{medians[b][part] / medians[a][part]:9.2f}x" if medians[a][part] > 0 else f"{'-':>10s}"
                for part in PARTS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
