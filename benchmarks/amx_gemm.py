"""The AMX int8 tile matmul against the AVX-512 VNNI kernel, one quantized linear per GGML type, rows 1..128.

    python benchmarks/amx_gemm.py --cpu-time                       # 5632x1024 and 1024x2816, Q8_0 Q4_0 Q4_K Q6_K
    python benchmarks/amx_gemm.py --formats q4_k --rows 8 12 16 --shapes 4864x896

Both kernels take the same activations (quantized per block of 32 to int8) and the same raw GGUF blocks
(``ggml_quantize`` of a Gaussian weight): ``amx`` is ``backends/amx_quant.py`` (``csrc/amx_quant.c``) called
directly, ``vnni`` is ``csrc/quant_dot.c``'s ``quant_matmul`` called directly (so the hook in
``native_quant.ggml_quant_matmul`` that picks between them by ``amx_quant.MIN_ROWS`` does not decide), and with
``--dequant`` the dequantize-tiles + float GEMM path that ``ggml_linear`` takes past 128 rows. ``--set-bytes``
of distinct weights are cycled so they come from memory, as in a decode step; the kernels are timed in turn
within each run (interleaved), medians of ``--runs``, milliseconds per linear and the ratio vnni / amx.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from gguf import GGMLQuantizationType

from pluginfer.backends.cpu import amx_quant
from pluginfer.backends.cpu import library as native_library
from pluginfer.backends.cpu import ops as native
from pluginfer.backends.cpu import quant as native_quant
from pluginfer.quant import ggml_blocks, ggml_quantize

T = GGMLQuantizationType


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--formats", nargs="+", default=["q8_0", "q4_0", "q4_k", "q6_k"])
    parser.add_argument("--shapes", nargs="+", default=["5632x1024", "1024x2816"],
                        help="OUTxIN (default: gate_up and down of the 0.5B-shaped benchmark llama)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 64, 128])
    parser.add_argument("--set-bytes", type=int, default=256 << 20)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--dequant", action="store_true", help="also time the dequantize + float GEMM path")
    parser.add_argument("--cpu-time", action="store_true",
                        help="one thread, timed by its CPU time (time.thread_time): on a shared machine, immune to "
                             "other processes' time slices (not to their memory traffic)")
    args = parser.parse_args()
    clock = time.perf_counter
    if args.cpu_time:
        clock = time.thread_time
        torch.set_num_threads(1)
    if native.available() is not None:
        print(f"native kernels unavailable: {native.available()}")
        return 1
    if amx_quant.library() is None:
        print("no AMX int8 tiles here (the log line says why)")
        return 1
    vnni_kernel = native_library.load().quant_matmul

    def vnni(x: torch.Tensor, raw: torch.Tensor, qtype: int, cols: int) -> torch.Tensor:
        out = torch.empty(x.shape[0], raw.shape[0])
        if vnni_kernel(qtype, x.data_ptr(), x.shape[0], cols, raw.data_ptr(), raw.shape[0], raw.shape[1], out.data_ptr()):
            raise RuntimeError("quant_matmul failed")
        return out

    kernels = {"amx": amx_quant.quant_matmul, "vnni": vnni}
    if args.dequant:
        kernels["dequant"] = lambda x, raw, qtype, cols: ggml_blocks.ggml_linear(x, raw, qtype, cols, None,
                                                                                 native_quant.ggml_dequantize)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads{' (CPU time)' if args.cpu_time else ''}; "
          f"ms per linear, medians of {args.runs} interleaved runs; MIN_ROWS {amx_quant.MIN_ROWS}")
    print(f"{'shape':>10} {'format':>6} {'rows':>5} " + " ".join(f"{name:>8}" for name in kernels) + "  vnni/amx")
    generator = torch.Generator().manual_seed(0)
    for shape in args.shapes:
        out_features, in_features = map(int, shape.split("x"))
        for fmt in args.formats:
            qtype = int(T[fmt.upper()])
            raw = ggml_quantize.quantize(torch.randn(out_features, in_features, generator=generator), T(qtype))
            weights = [raw.clone() for _ in range(max(2, args.set_bytes // raw.nbytes))]
            for rows in args.rows:
                x = torch.randn(rows, in_features, generator=generator)
                samples: dict[str, list[float]] = {name: [] for name in kernels}
                for run in range(args.runs + 1):  # the first run warms up
                    for name, kernel in kernels.items():
                        start = clock()
                        for w in weights:
                            kernel(x, w, qtype, in_features)
                        if run:
                            samples[name].append((clock() - start) / len(weights))
                ms = {name: statistics.median(values) * 1e3 for name, values in samples.items()}
                print(f"{shape:>10} {fmt:>6} {rows:>5} " + " ".join(f"{ms[name]:>8.3f}" for name in kernels)
                      + f"  {ms['vnni'] / ms['amx']:>7.2f}x", flush=True)
            del weights
    return 0


if __name__ == "__main__":
    sys.exit(main())
