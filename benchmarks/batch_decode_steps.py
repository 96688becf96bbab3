"""Decode steps of a batch of sequences on one GGUF (or HF) model, timed apart from their prefill, for profiling.

    python benchmarks/batch_decode_steps.py DIR/model-q4_k_m.gguf                 # 16 sequences, one thread
    mkfifo /tmp/ctl && PERF_CTL=/tmp/ctl perf record -D -1 --control fifo:/tmp/ctl -o q4km.data \\
        python benchmarks/batch_decode_steps.py DIR/model-q4_k_m.gguf --perf-control /tmp/ctl
    perf report -i q4km.data --sort dso,sym                                        # the decode steps only

Each run adds ``--batch`` requests of ``--prompt`` random tokens, runs the prefill and the first decode step
untimed, then times ``--steps`` decode steps by the process's CPU time (and the wall clock), as a batch-16
row of ``vs_llamacpp.py`` does (prompt 128, contexts 129-160). With ``--perf-control`` (a ``perf record
--control fifo:...`` FIFO) perf samples only those steps, so a profile holds no prefill. The first run warms
up (the step's recording, the kernels' libraries) and is not reported. ``--threads`` torch/OpenMP threads.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--steps", type=int, default=31)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--vocab", type=int, default=32000, help="prompt tokens are drawn from 10..vocab-10")
    parser.add_argument("--enforce-eager", action="store_true", help="no replayed decode steps")
    parser.add_argument("--kv-cache-dtype", default="auto", help="the KV cache's dtype (auto: the model's)")
    parser.add_argument("--perf-control", default=None, help="a perf --control FIFO: enabled around the timed steps")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from pluginfer import LLM, SamplingParams

    llm = LLM(model=args.model, max_model_len=args.prompt + args.steps + 64, max_num_seqs=args.batch,
              enable_prefix_caching=False, max_num_batched_tokens=max(2048, args.batch * args.prompt),
              enforce_eager=args.enforce_eager, kv_cache_dtype=args.kv_cache_dtype)
    engine = llm.engine
    rng = np.random.default_rng(0)
    prompts = [rng.integers(10, args.vocab - 10, args.prompt).tolist() for _ in range(args.batch)]
    control = open(args.perf_control, "w") if args.perf_control else None  # noqa: SIM115 (held for the run)
    per_step = []
    for run in range(args.runs + 1):
        for prompt in prompts:
            engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=args.steps + 2, ignore_eos=True))
        engine.step()  # the prefill (one step: the token budget holds every prompt)
        engine.step()  # the first decode step
        if control and run:
            control.write("enable\n")
            control.flush()
        cpu, wall = time.process_time(), time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        if control and run:
            control.write("disable\n")
            control.flush()
        while engine.has_unfinished_requests():
            engine.step()
        if run:
            per_step.append(cpu / args.steps)
            print(f"run {run}: {cpu / args.steps * 1e3:.2f} ms CPU time per step ({wall / args.steps * 1e3:.2f} ms wall), "
                  f"{args.batch / (cpu / args.steps):.1f} tokens per CPU-second", flush=True)
    step = statistics.median(per_step)
    print(f"median: {step * 1e3:.2f} ms per step, {args.batch / step:.1f} tokens per CPU-second "
          f"(batch {args.batch}, {args.threads} threads)")


if __name__ == "__main__":
    main()
