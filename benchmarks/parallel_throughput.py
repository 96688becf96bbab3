"""Tensor and pipeline parallelism against one rank: decode tokens/s, traffic and time in communication.

    python benchmarks/parallel_throughput.py                       # 8-layer llama, hidden 1024, fp32
    python benchmarks/parallel_throughput.py --layers 2 --runs 1   # quick smoke run

Each layout (TP 1, TP 2, PP 2) is one engine (the others spawned over gloo on 127.0.0.1); runs
alternate between them and medians are reported. Decode tokens/s = batch * (gen_len - 1) /
(time(gen_len tokens) - time(1 token)). Communication is measured on rank 0, by wrapping its
tensor-parallel group and world collective: calls, bytes and seconds per decode step, where the
seconds include waiting for the slower rank (a collective returns when every rank has arrived).
On a 2-core machine two ranks share the cores the single rank had: expect no speed-up, only the cost.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from offline_throughput import build_checkpoint  # noqa: E402 - the same random llama builder

LAYOUTS = {"tp1": {}, "tp2": {"tensor_parallel_size": 2}, "pp2": {"pipeline_parallel_size": 2}}
OPERATIONS = ("all_reduce", "all_gather", "broadcast_object", "send", "recv")


class Meter:
    """Wraps a collective's methods on the instance (layers hold the same object): calls, bytes, seconds."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self.bytes: dict[str, int] = {}
        self.seconds = 0.0

    def wrap(self, collective: object) -> None:
        for name in OPERATIONS:
            original = getattr(collective, name)
            setattr(collective, name, functools.partial(self._timed, name, original))

    def _timed(self, name: str, original, *args, **kwargs):  # any collective call
        start = time.perf_counter()
        result = original(*args, **kwargs)
        self.seconds += time.perf_counter() - start
        self.calls[name] = self.calls.get(name, 0) + 1
        first = args[0] if args else None
        self.bytes[name] = self.bytes.get(name, 0) + (first.nbytes if isinstance(first, torch.Tensor) else 0)
        return result

    def reset(self) -> None:
        self.calls, self.bytes, self.seconds = {}, {}, 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--gen-len", type=int, default=32)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    args.arch, args.experts, args.top_k = "llama", 0, 0

    from pluginfer import LLM

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model"
        build_checkpoint(path, args)
        prompts = {b: [[(7 * i + 13 * j) % (args.vocab - 10) + 10 for j in range(args.prompt_len)]
                       for i in range(b)] for b in args.batch}
        print(f"model: llama, {args.layers} layers, hidden {args.hidden}, intermediate {args.intermediate}, "
              f"heads {args.heads}/{args.kv_heads}, vocab {args.vocab}, float32; {torch.get_num_threads()} threads")
        single = LLM(str(path), dtype="float32", max_num_seqs=max(args.batch))
        # torch.distributed allows one world per process: the parallel layouts run one after the other, each
        # interleaved with the single-rank engine.
        for name, parallel in LAYOUTS.items():
            if not parallel:
                continue
            engine = LLM(str(path), dtype="float32", max_num_seqs=max(args.batch), **parallel)
            meter = Meter()
            worker = engine.engine.executor.worker
            meter.wrap(worker.tp_group)
            if worker.world is not worker.tp_group:
                meter.wrap(worker.world)
            for batch in args.batch:
                rates: dict[str, list[float]] = {"tp1": [], name: []}
                for _ in range(args.runs):
                    for label, llm in (("tp1", single), (name, engine)):  # interleaved
                        meter.reset()
                        first = timed(llm, prompts[batch], 1)
                        prefill = (dict(meter.calls), dict(meter.bytes), meter.seconds)
                        meter.reset()
                        full = timed(llm, prompts[batch], args.gen_len)
                        rates[label].append(batch * (args.gen_len - 1) / (full - first))
                        if label == name:  # decode steps only: this run minus the one-token run
                            steps = args.gen_len - 1
                            calls = (sum(meter.calls.values()) - sum(prefill[0].values())) / steps
                            nbytes = (sum(meter.bytes.values()) - sum(prefill[1].values())) / steps
                            comm_ms = (meter.seconds - prefill[2]) / steps * 1000
                            step_ms = (full - first) / steps * 1000
                            per_layer = {op: round((count - prefill[0].get(op, 0)) / steps / args.layers, 2)
                                         for op, count in meter.calls.items() if op in ("all_reduce", "all_gather")}
                base, median = statistics.median(rates["tp1"]), statistics.median(rates[name])
                print(f"batch {batch:3d}: tp1 {base:8.1f} tok/s | {name} {median:8.1f} tok/s ({median / base:4.2f}x); "
                      f"rank 0 per decode step: {calls:5.1f} collective calls, {nbytes / batch:6.0f} tensor bytes per token, "
                      f"{comm_ms:6.2f} of {step_ms:6.2f} ms in collectives; per layer {per_layer}")
            engine.close()


def timed(llm: object, prompts: list[list[int]], tokens: int) -> float:
    from pluginfer import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, params)
    return time.perf_counter() - start

if __name__ == "__main__":
    main()
