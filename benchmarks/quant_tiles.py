"""The large-row paths of one GGML linear: bfloat16 tiles vs float32 tiles vs the fused int8 kernel, by rows.

    python benchmarks/quant_tiles.py --cpu-time                     # q8_0 q4_0 q4_k, 5632x1024 and 1024x2816
    python benchmarks/quant_tiles.py --cpu-time --formats q4_k --rows 8 16 24 32 48 64

Three ways of ``x @ W.T`` for ``x [rows, in]`` float32 and ``W`` a random weight quantized to the format,
as ``ggml_blocks.ggml_linear`` runs them on the cpu backend: ``bf16`` (tiles of 512 output rows
dequantized straight to bfloat16 by the C kernel, ``x`` rounded to bfloat16 once, torch's bfloat16 GEMM:
oneDNN on AMX where the CPU has it), ``f32`` (tiles dequantized to float32, torch's float32 GEMM: the path
before) and ``fused`` (``native_quant.ggml_quant_matmul``: int8 activations against the blocks, no tile). The
three are timed in turn within each run (``quant_gemv.interleaved_medians``), milliseconds per linear,
medians of ``--runs``; ``--set-bytes`` of distinct weights are cycled so they come from memory. The last
columns are ratios: how many times faster bf16 is than each of the others. First, per format, the C
kernel alone: one tile of 512 rows dequantized to bfloat16 and to float32 (in cache, 20 calls per run). The crossover row count the
cpu backend uses (``native_quant.QUANT_MATMUL_MAX_ROWS``) is read off these: the fused kernel up to it, tiles above.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType

sys.path.insert(0, str(Path(__file__).parent))
import quant_gemv  # noqa: E402

from pluginfer.backends.cpu import ops as native  # noqa: E402
from pluginfer.backends.cpu import quant as native_quant
from pluginfer.quant import ggml_blocks  # noqa: E402

T = GGMLQuantizationType


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--formats", nargs="+", default=["q8_0", "q4_0", "q4_k"])
    parser.add_argument("--shapes", nargs="+", default=["5632x1024", "1024x2816"],
                        help="OUTxIN (default: gate_up and down of the 0.5B-shaped benchmark llama)")
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 32, 64, 128, 256, 512])
    parser.add_argument("--set-bytes", type=int, default=64 << 20,
                        help="bytes of distinct quantized weights cycled per format (clones of one weight)")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--cpu-time", action="store_true",
                        help="one thread, timed by its CPU time (time.thread_time): on a shared machine, immune to "
                             "other processes' time slices (not to their memory traffic)")
    args = parser.parse_args()
    if args.cpu_time:
        quant_gemv.CLOCK = time.thread_time
        torch.set_num_threads(1)
    if native.available() is not None:
        print(f"native kernels unavailable: {native.available()}")
        return 1
    fused_ok = native_quant.quant_dot_supported()
    bf16_tiles = native_quant.GGMLDequantize(native_quant.ggml_dequantize, None, torch.bfloat16)
    bf16_tiles.tile_dtype_min_rows = 0  # bfloat16 tiles at every row count here (the engine: from 32 rows)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads{' (CPU time)' if args.cpu_time else ''}; "
          f"AMX-BF16 GEMM: {native_quant.bfloat16_gemm_is_fast()}; ms per linear, medians of {args.runs}")
    print(f"{'shape':>10} {'format':>6} {'rows':>5} {'bf16':>8} {'f32':>8} {'fused':>8}  {'f32/bf16':>8} "
          f"{'fused/bf16':>10}  {'bf16 GMAC/s':>11}")
    generator = torch.Generator().manual_seed(0)
    rng = np.random.default_rng(0)
    for shape in args.shapes:
        out_features, in_features = map(int, shape.split("x"))
        for fmt in args.formats:
            qtype = T[fmt.upper()]
            raw = quant_gemv.quantized(torch.randn(out_features, in_features, generator=generator), qtype, rng)
            weights = [raw.clone() for _ in range(max(2, args.set_bytes // raw.nbytes))]
            tile = raw[:512]
            buffers = {dtype: torch.empty(tile.shape[0] * in_features, dtype=dtype)
                       for dtype in (torch.float32, torch.bfloat16)}
            dequant = quant_gemv.interleaved_medians({
                dtype: lambda buffer=buffer, tile=tile, qtype=qtype, cols=in_features: [
                    native_quant.ggml_dequantize(tile, qtype, cols, buffer) for _ in range(20)]
                for dtype, buffer in buffers.items()}, args.runs)
            print(f"{shape:>10} {fmt:>6} dequantize one {tile.shape[0]}-row tile: bfloat16 "
                  f"{dequant[torch.bfloat16] / 20 * 1e3:.3f} ms, float32 {dequant[torch.float32] / 20 * 1e3:.3f} ms")
            for rows in args.rows:
                x = torch.randn(rows, in_features, generator=generator)
                cases = {
                    "bf16": lambda x=x, qtype=qtype, cols=in_features, weights=weights: [
                        ggml_blocks.ggml_linear(x, w, qtype, cols, None, bf16_tiles) for w in weights],
                    "f32": lambda x=x, qtype=qtype, cols=in_features, weights=weights: [
                        ggml_blocks.ggml_linear(x, w, qtype, cols, None, native_quant.ggml_dequantize) for w in weights],
                }
                if fused_ok:
                    cases["fused"] = lambda x=x, qtype=qtype, cols=in_features, weights=weights: [
                        native_quant.ggml_quant_matmul(x, w, int(qtype), cols) for w in weights]
                medians = quant_gemv.interleaved_medians(cases, args.runs)
                ms = {name: medians.get(name, float("nan")) / len(weights) * 1e3 for name in ("bf16", "f32", "fused")}
                rate = rows * out_features * in_features / (ms["bf16"] / 1e3) / 1e9
                print(f"{shape:>10} {fmt:>6} {rows:>5} {ms['bf16']:>8.3f} {ms['f32']:>8.3f} {ms['fused']:>8.3f}  "
                      f"{ms['f32'] / ms['bf16']:>7.2f}x {ms['fused'] / ms['bf16']:>9.2f}x  {rate:>11.0f}", flush=True)
            del weights
    return 0


if __name__ == "__main__":
    sys.exit(main())
