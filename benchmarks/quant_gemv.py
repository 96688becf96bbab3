"""One quantized linear per GGML format: the fused int8-activation kernel vs dequantize + float GEMM vs float32.

    python benchmarks/quant_gemv.py                 # gate_up 1024 -> 5632 and down 2816 -> 1024, rows 1 4 16
    python benchmarks/quant_gemv.py --formats q4_0 q8_0 --rows 1 16 64 128 --shapes 4864x896

For each format a random weight is quantized (``ggml_quantize``; Q5_K, which we do not quantize, gets
random blocks with sane scales) and timed three ways, as ``ggml_blocks.ggml_linear`` runs it:
``fused`` (``native_quant.ggml_quant_matmul``: activations quantized per block of 32 to int8, integer dot
products with the packed weight, ``csrc/quant_dot.c``), ``dequant`` (the path before it: a tile of 512
rows dequantized into a float32 buffer by the C kernel, then ``torch.matmul``) and ``f32`` (the dense
float32 weight through the engine's panel kernel, ``layers/dense.py``). ``--set-bytes`` of
distinct weights are cycled so they come from memory, not from cache (the machine reports a large
L3), as in a decode step; the three are timed in turn within each run. Milliseconds per linear
(medians of ``--runs``), and GB/s of weight bytes read (the weight's stored bytes / time) against
the machine's read bandwidth, measured first (``torch.sum`` over ``--bandwidth-bytes``, all threads).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from pluginfer.backends.cpu import library as native_library
from pluginfer.backends.cpu import ops as native
from pluginfer.backends.cpu import panels as native_panels
from pluginfer.backends.cpu import quant as native_quant
from pluginfer.quant import ggml_blocks, ggml_quantize

T = GGMLQuantizationType


CLOCK = time.perf_counter


def interleaved_medians(cases: dict, runs: int) -> dict[str, float]:
    """Median seconds of each case, the cases timed in turn within every run (drift hits them alike)."""
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for fn in cases.values():
        fn()
    for _ in range(runs):
        for name, fn in cases.items():
            start = CLOCK()
            fn()
            samples[name].append(CLOCK() - start)
    return {name: statistics.median(values) for name, values in samples.items()}


def read_bandwidth(nbytes: int, runs: int) -> float:
    """GB/s of a float32 sum over ``nbytes`` (every byte read once, from memory)."""
    buffer = torch.ones(nbytes // 4, dtype=torch.float32)
    seconds = interleaved_medians({"sum": buffer.sum}, runs)["sum"]
    return nbytes / seconds / 1e9


def quantized(weight: torch.Tensor, qtype: T, generator: np.random.Generator) -> torch.Tensor:
    if qtype in ggml_quantize.QUANTIZABLE:
        return ggml_quantize.quantize(weight, qtype)
    # Q5_K: random levels with d, dmin ~ 2^-9 (fp16 0x1800)
    block_weights, type_size = GGML_QUANT_SIZES[qtype]
    raw = generator.integers(0, 256, size=(weight.shape[0], weight.shape[1] // block_weights, type_size),
                             dtype=np.uint8)
    raw[:, :, 0:4] = [0x00, 0x18, 0x00, 0x18]
    return torch.from_numpy(raw.reshape(weight.shape[0], -1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--formats", nargs="+", default=["q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k"])
    parser.add_argument("--shapes", nargs="+", default=["5632x1024", "1024x2816"],
                        help="OUTxIN (default: gate_up and down of the 0.5B-shaped benchmark llama)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--set-bytes", type=int, default=512 << 20,
                        help="bytes of distinct weights cycled per format (clones of one quantized weight), and "
                             "of float32 weights; larger than the caches so weights come from memory")
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--bandwidth-bytes", type=int, default=1 << 30)
    parser.add_argument("--no-f32", action="store_true", help="skip the float32 panel weights")
    parser.add_argument("--cpu-time", action="store_true",
                        help="one thread, timed by its CPU time (time.thread_time): on a shared machine, immune to "
                             "other processes' time slices (not to their memory traffic); GB/s are per core")
    args = parser.parse_args()
    if args.cpu_time:
        global CLOCK
        CLOCK = time.thread_time
        torch.set_num_threads(1)
    if native.available() is not None:
        print(f"native kernels unavailable: {native.available()}")
        return 1
    if not native_library.load().quant_dot_supported():
        print("this CPU has no AVX-512 VNNI: the fused kernel is not built")
        return 1
    panels = native.op("panel_linear") is not None
    bandwidth = read_bandwidth(args.bandwidth_bytes, args.runs)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads{' (CPU time)' if args.cpu_time else ''}; "
          f"read bandwidth (sum of {args.bandwidth_bytes / 2**20:.0f} MiB) {bandwidth:.1f} GB/s; ms per linear, "
          f"medians of {args.runs}")
    print(f"{'shape':>10} {'format':>6} {'rows':>5} {'fused':>8} {'dequant':>8} {'f32':>8}  {'fused/deq':>9} "
          f"{'fused/f32':>9}  {'fused GB/s':>10} {'% of read':>9}")
    generator = torch.Generator().manual_seed(0)
    rng = np.random.default_rng(0)
    for shape in args.shapes:
        out_features, in_features = map(int, shape.split("x"))
        dense = []
        if not args.no_f32 and panels:
            packed = native_panels.pack_panels(torch.randn(out_features, in_features, generator=generator))
            dense = [packed.clone() for _ in range(max(2, args.set_bytes // packed.nbytes))]
            del packed
        for fmt in args.formats:
            qtype = T[fmt.upper()]
            raw = quantized(torch.randn(out_features, in_features, generator=generator), qtype, rng)
            weights = [raw.clone() for _ in range(max(2, args.set_bytes // raw.nbytes))]
            for rows in args.rows:
                x = torch.randn(rows, in_features, generator=generator)
                cases = {
                    "fused": lambda x=x, weights=weights, qtype=qtype, cols=in_features: [
                        native_quant.ggml_quant_matmul(x, w, int(qtype), cols) for w in weights],
                    "dequant": lambda x=x, weights=weights, qtype=qtype, cols=in_features: [
                        ggml_blocks.ggml_linear(x, w, qtype, cols, None, native_quant.ggml_dequantize) for w in weights],
                }
                if dense:
                    cases["f32"] = lambda x=x, dense=dense, n=out_features: [native_panels.panel_linear(x, w, n) for w in dense]
                medians = interleaved_medians(cases, args.runs)
                timings = {"fused": medians["fused"] / len(weights), "dequant": medians["dequant"] / len(weights),
                           "f32": medians["f32"] / len(dense) if dense else float("nan")}
                rate = raw.nbytes / timings["fused"] / 1e9
                print(f"{shape:>10} {fmt:>6} {rows:>5} {timings['fused'] * 1e3:>8.3f} {timings['dequant'] * 1e3:>8.3f} "
                      f"{timings['f32'] * 1e3:>8.3f}  {timings['dequant'] / timings['fused']:>8.2f}x "
                      f"{timings['f32'] / timings['fused']:>8.2f}x  {rate:>10.1f} {100 * rate / bandwidth:>8.0f}%",
                      flush=True)
            del weights
    return 0


if __name__ == "__main__":
    sys.exit(main())
