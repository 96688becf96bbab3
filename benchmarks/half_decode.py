"""16-bit decode of the 0.5B-shaped llama: bfloat16 / float16 on the native GEMV, against the torch path it
replaced, our float32 and llama.cpp on an F16 GGUF file of the same weights, interleaved, one process.

    python benchmarks/half_decode.py                        # 24 layers, hidden 1024, vocab 32000; 3 runs
    python benchmarks/half_decode.py --layers 2 --runs 1    # quick smoke run
    python benchmarks/half_decode.py --no-llamacpp          # without llama-cpp-python
    python benchmarks/half_decode.py --cpu-time             # one thread, timed by CPU time (a shared machine)

A random llama is built locally (``offline_throughput.build_checkpoint``) and, for llama.cpp, written as
an F16 GGUF file by ``pluginfer convert`` (llama-cpp-python's C API, ``vs_llamacpp.LlamaCpp``). Engines:
``f32``, ``bf16``, ``f16`` (pluginfer on the HF checkpoint with that ``--dtype``), ``bf16-torch`` and
``f16-torch`` (engines of their own with ``native_half_linear.HALF_LINEAR_MAX_ROWS`` and ``amx_half.MAX_ROWS`` at 0
for their runs: every 16-bit linear through ``F.linear``, the path before the native kernels), ``bf16-noamx`` and
``f16-noamx`` (engines of their own with ``amx_half.MAX_ROWS`` at 0 for their runs: the GEMV and torch's GEMM as
before the AMX bfloat16 tiles of ``csrc/amx_half.c``), ``f16-gguf`` (pluginfer on llama.cpp's F16 file, the very
file ``llama.cpp-F16`` reads, with ``--dtype float16``), ``llama.cpp-F16``. A variant needs an engine of its own:
an engine replays each decode batch size with the kernels its step of that size recorded (the second; the first runs eagerly). Each run times every
engine in turn: batch-1 decode (prompt 128, then ``--b1-tokens`` greedy tokens, the prefill excluded) and
batch-16 decode (16 prompts of 128, ``--b16-tokens`` tokens each). Medians of ``--runs``, tokens/s, ratios
to llama.cpp, and the memory-bandwidth bound: the weight bytes a batch-1 token reads (every linear and
the LM head), the rate they are read at (bytes x tokens/s) and the machine's read bandwidth (``torch.sum``
over 1 GiB, all threads).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
import vs_llamacpp  # noqa: E402
from offline_throughput import build_checkpoint  # noqa: E402
from vs_llamacpp import LlamaCpp, write_files  # noqa: E402

from pluginfer.backends.cpu import amx_half  # noqa: E402
from pluginfer.backends.cpu import half_linear as native_half_linear


class Ours(vs_llamacpp.Ours):
    """pluginfer on the HF checkpoint in ``dtype``; ``torch_path``: 16-bit linears through F.linear; ``tiles``:
    False keeps the AMX bfloat16 tiles off (an engine of its own: a replayed step keeps the kernels it recorded)."""

    def __init__(self, name: str, path: Path, dtype: str, torch_path: bool = False, llm: object = None,
                 tiles: bool = True) -> None:
        from pluginfer import LLM

        self.name, self.dtype, self.torch_path, self.tiles = name, getattr(torch, dtype), torch_path, tiles
        self.llm = llm or LLM(model=str(path), dtype=dtype, max_model_len=320, max_num_seqs=16,
                              enable_prefix_caching=False, max_num_batched_tokens=2048)

    def decode_rate(self, prompts: list[list[int]], new_tokens: int) -> float:
        limits, tiles = native_half_linear.HALF_LINEAR_MAX_ROWS, amx_half.MAX_ROWS
        saved, saved_tiles = dict(limits), dict(tiles)
        if self.torch_path and self.dtype in limits:
            limits[self.dtype] = 0
        if (self.torch_path or not self.tiles) and self.dtype in tiles:
            tiles[self.dtype] = 0
        try:
            return super().decode_rate(prompts, new_tokens)
        finally:
            limits.update(saved)
            tiles.update(saved_tiles)


def read_bandwidth(nbytes: int = 1 << 30) -> float:
    """Bytes/s of a float32 sum over ``nbytes`` (every byte read once, all threads), median of 5."""
    buffer = torch.ones(nbytes // 4, dtype=torch.float32)
    buffer.sum()
    times = []
    for _ in range(5):
        start = vs_llamacpp.clock()
        buffer.sum()
        times.append(vs_llamacpp.clock() - start)
    return nbytes / statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--b1-tokens", type=int, default=64)
    parser.add_argument("--b16-tokens", type=int, default=16)
    parser.add_argument("--engines", nargs="+",
                        default=["f32", "bf16", "bf16-torch", "f16", "f16-torch", "llama.cpp-F16"])
    parser.add_argument("--no-llamacpp", action="store_true")
    parser.add_argument("--cpu-time", action="store_true",
                        help="one thread, timed by the process's CPU time (time.process_time): on a shared machine, immune to "
                             "other processes' time slices (not to their memory traffic); GB/s are per core")
    parser.add_argument("--work-dir", type=Path, default=None, help="keep the model and files here between runs")
    args = parser.parse_args()
    args.arch, args.experts, args.top_k = "llama", 0, 0
    args.batch_sizes = [1, 16]  # what vs_llamacpp's engines size their batches for
    if args.cpu_time:
        vs_llamacpp.clock = time.process_time  # what both engines' decode loops time with
        args.threads = 1
    torch.set_num_threads(args.threads)
    engines_asked = [e for e in args.engines if not (args.no_llamacpp and e.startswith("llama.cpp"))]

    with tempfile.TemporaryDirectory() as tmp:
        root = args.work_dir or Path(tmp)
        model_dir = root / "hf"
        if not (model_dir / "config.json").exists():
            build_checkpoint(model_dir, args)
        rng = np.random.default_rng(0)
        prompts16 = [rng.integers(10, args.vocab - 10, 128).tolist() for _ in range(16)]
        head_dim = args.hidden // args.heads
        linear_params = args.layers * args.hidden * (
            args.hidden + 2 * args.kv_heads * head_dim + args.hidden + 3 * args.intermediate) + args.vocab * args.hidden
        bandwidth = read_bandwidth()
        print(f"llama {args.layers} layers, hidden {args.hidden}, intermediate {args.intermediate}, vocab {args.vocab}; "
              f"{args.threads} threads{' (CPU time)' if args.cpu_time else ''}; native GEMV {native_half_linear.half_linear_isa()}; read bandwidth "
              f"{bandwidth / 1e9:.1f} GB/s; weights read per batch-1 token: {linear_params * 2 / 1e6:.0f} MB "
              f"(16-bit), {linear_params * 4 / 1e6:.0f} MB (float32)", flush=True)
        engines: list = []
        for name in engines_asked:
            if name == "llama.cpp-F16":
                path = write_files(model_dir, root, ["f16"])["f16"]
                engine = LlamaCpp(path, args)
                engine.name, engine.dtype = name, torch.float16
            elif name == "f16-gguf":  # ours on llama.cpp's own F16 file
                engine = Ours(name, write_files(model_dir, root, ["f16"])["f16"], "float16")
            else:
                base = name.removesuffix("-torch").removesuffix("-noamx")
                dtype = {"f32": "float32", "bf16": "bfloat16", "f16": "float16"}[base]
                if name.endswith(("-noamx", "-torch")):  # its own engine: replays keep the kernels they recorded
                    engine = Ours(name, model_dir, dtype, name.endswith("-torch"), tiles=False)
                else:
                    engine = Ours(name, model_dir, dtype)
            engines.append(engine)
        results = {e.name: {"b1": [], "b16": []} for e in engines}
        for run in range(args.runs):
            for engine in engines:  # interleaved
                results[engine.name]["b1"].append(engine.decode_rate(prompts16[:1], args.b1_tokens))
                results[engine.name]["b16"].append(engine.decode_rate(prompts16, args.b16_tokens))
            print(f"run {run + 1}/{args.runs}: " + ", ".join(
                f"{n} {r['b1'][-1]:.1f}/{r['b16'][-1]:.1f}" for n, r in results.items()), flush=True)
        reference = "llama.cpp-F16" if "llama.cpp-F16" in results else None
        print(f"{'engine':>14} {'b1 tok/s':>9} {'b16 tok/s':>10} {'b1 vs ref':>9} {'b16 vs ref':>10} "
              f"{'b1 GB/s':>8} {'% of read':>9} {'bound tok/s':>11}")
        for engine in engines:
            b1, b16 = (statistics.median(results[engine.name][m]) for m in ("b1", "b16"))
            ratio = ("", "")
            if reference:
                ratio = (f"{b1 / statistics.median(results[reference]['b1']):8.2f}x",
                         f"{b16 / statistics.median(results[reference]['b16']):9.2f}x")
            nbytes = linear_params * (4 if engine.dtype == torch.float32 else 2)
            print(f"{engine.name:>14} {b1:9.1f} {b16:10.1f} {ratio[0]:>9} {ratio[1]:>10} {nbytes * b1 / 1e9:8.1f} "
                  f"{100 * nbytes * b1 / bandwidth:8.0f}% {bandwidth / nbytes:11.1f}")


if __name__ == "__main__":
    main()
