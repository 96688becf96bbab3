"""16-bit dense linears: the native bfloat16/float16 GEMV against torch's and against our float32.

    python benchmarks/half_gemv.py                       # the 0.5B-shaped llama's linears, rows 1 4 16 64
    python benchmarks/half_gemv.py --rows 1 16 64 128 512 --dtypes bfloat16 --shapes 5632x1024

For each ``OUTxIN`` shape and dtype, a random weight is timed four ways, in turn within each run:
``native`` (``native_half_linear.half_linear``, ``csrc/half_linear.c``: the checkpoint's ``[out, in]`` weight,
float32 sums), ``torch`` (``F.linear`` on the same ``[out, in]`` tensor: what rows above
``HALF_LINEAR_MAX_ROWS`` run), ``torch_t`` (``torch.matmul`` on ``[in, out]``: the cpu backend's
16-bit path before the native kernel) and ``f32`` (the same weight in float32 through the panel
kernel, the engine's float32 path); where the CPU has AMX-BF16, ``amx`` too (``amx_half.linear``,
``csrc/amx_half.c``: AMX bfloat16 tiles on the same ``[out, in]`` weight, what ``amx_half.MIN_ROWS`` to
``MAX_ROWS`` rows run; ``native`` is then the GEMV alone, with the tiles off). ``--set-bytes`` of distinct weights are cycled so that each
comes from memory, not from cache, as in a decode step. Milliseconds per linear (medians of
``--runs``), ratios, and the GB/s of weight bytes the native kernel reads against the machine's
read bandwidth (``torch.sum`` over ``--bandwidth-bytes``, all threads), measured first.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
import quant_gemv  # noqa: E402
from quant_gemv import interleaved_medians, read_bandwidth  # noqa: E402

from pluginfer.backends.cpu import amx_half  # noqa: E402
from pluginfer.backends.cpu import half_linear as native_half_linear
from pluginfer.backends.cpu import ops as native
from pluginfer.backends.cpu import panels as native_panels

# The linears of the 0.5B-shaped benchmark llama (benchmarks/offline_throughput.py): qkv, o, gate_up, down, lm_head.
SHAPES = ["2048x1024", "1024x1024", "5632x1024", "1024x2816", "32000x1024"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=SHAPES, help="OUTxIN (default: the 0.5B-shaped llama's)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float16"], choices=["bfloat16", "float16"])
    parser.add_argument("--set-bytes", type=int, default=256 << 20,
                        help="bytes of distinct 16-bit weights cycled per case (twice that in float32)")
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--bandwidth-bytes", type=int, default=1 << 30)
    parser.add_argument("--no-f32", action="store_true", help="skip the float32 panel weights")
    parser.add_argument("--cpu-time", action="store_true",
                        help="one thread, timed by its CPU time (time.thread_time): on a shared machine, immune to "
                             "other processes' time slices (not to their memory traffic); GB/s are per core")
    args = parser.parse_args()
    if args.cpu_time:
        quant_gemv.CLOCK = time.thread_time  # what interleaved_medians times with
        torch.set_num_threads(1)
    if native.available() is not None or native_half_linear.half_linear_isa() is None:
        print(f"no native 16-bit GEMV here: {native.available() or 'this CPU lacks AVX2 + F16C'}")
        return 1
    panels = native.op("panel_linear") is not None and not args.no_f32
    bandwidth = read_bandwidth(args.bandwidth_bytes, args.runs)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads{' (CPU time)' if args.cpu_time else ''}, native GEMV {native_half_linear.half_linear_isa()}; "
          f"read bandwidth (sum of {args.bandwidth_bytes / 2**20:.0f} MiB) {bandwidth:.1f} GB/s; "
          f"ms per linear, medians of {args.runs}, interleaved")
    tiles = amx_half.library() is not None
    print(f"{'shape':>10} {'dtype':>8} {'rows':>5} {'native':>8} {'torch':>8} {'torch_t':>8} {'f32':>8}  "
          f"{'torch/nat':>9} {'tor_t/nat':>9} {'f32/nat':>8}  {'GB/s':>6} {'% read':>6}"
          + (f"  {'amx':>8} {'nat/amx':>8} {'torch/amx':>9} {'amx GB/s':>8}" if tiles else ""))
    generator = torch.Generator().manual_seed(0)
    saved = native_half_linear.HALF_LINEAR_MAX_ROWS
    native_half_linear.HALF_LINEAR_MAX_ROWS = {dtype: max(args.rows) for dtype in saved}  # the kernel at every row count asked
    saved_tiles = amx_half.MIN_ROWS
    amx_half.MIN_ROWS = {}  # native: the GEMV alone
    try:
        for shape in args.shapes:
            out_features, in_features = map(int, shape.split("x"))
            base = torch.randn(out_features, in_features, generator=generator) * 0.05
            copies = max(2, args.set_bytes // (base.numel() * 2))
            dense = [native_panels.pack_panels(base) for _ in range(copies)] if panels else []
            for dtype_name in args.dtypes:
                dtype = getattr(torch, dtype_name)
                weights = [base.to(dtype) for _ in range(copies)]
                transposed = [w.t().contiguous() for w in weights]
                for rows in args.rows:
                    x = torch.randn(rows, in_features, generator=generator)
                    xh = x.to(dtype)
                    cases = {
                        "native": lambda xh=xh, weights=weights: [native_half_linear.half_linear(xh, w, None) for w in weights],
                        "torch": lambda xh=xh, weights=weights: [F.linear(xh, w) for w in weights],
                        "torch_t": lambda xh=xh, ts=transposed: [torch.matmul(xh, t) for t in ts],
                    }
                    if tiles:
                        cases["amx"] = lambda xh=xh, weights=weights: [amx_half.linear(xh, w) for w in weights]
                    if dense:
                        cases["f32"] = lambda x=x, dense=dense, n=out_features: [native_panels.panel_linear(x, w, n)
                                                                                 for w in dense]
                    medians = {name: seconds / copies for name, seconds in interleaved_medians(cases, args.runs).items()}
                    f32 = medians.get("f32", float("nan"))
                    rate = out_features * in_features * 2 / medians["native"] / 1e9
                    print(f"{shape:>10} {dtype_name:>8} {rows:>5} {medians['native'] * 1e3:>8.3f} "
                          f"{medians['torch'] * 1e3:>8.3f} {medians['torch_t'] * 1e3:>8.3f} {f32 * 1e3:>8.3f}  "
                          f"{medians['torch'] / medians['native']:>8.2f}x {medians['torch_t'] / medians['native']:>8.2f}x "
                          f"{f32 / medians['native']:>7.2f}x  {rate:>6.1f} {100 * rate / bandwidth:>5.0f}%"
                          + (f"  {medians['amx'] * 1e3:>8.3f} {medians['native'] / medians['amx']:>7.2f}x "
                             f"{medians['torch'] / medians['amx']:>8.2f}x "
                             f"{out_features * in_features * 2 / medians['amx'] / 1e9:>8.1f}" if tiles else ""),
                          flush=True)
                del weights, transposed
            del dense
    finally:
        native_half_linear.HALF_LINEAR_MAX_ROWS = saved
        amx_half.MIN_ROWS = saved_tiles
    return 0


if __name__ == "__main__":
    sys.exit(main())
