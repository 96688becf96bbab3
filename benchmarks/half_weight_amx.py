"""float32 activations against a 16-bit weight: half_weight_linear's GEMV against the AMX bfloat16 tiles.

    python benchmarks/half_weight_amx.py                          # the Q4_0 file's F16 head, 32000x1024
    python benchmarks/half_weight_amx.py --dtype bfloat16 --rows 4 6 8 12 --weights 1

For each row count, ``gemv`` (``half_weight_linear`` of ``csrc/half_linear.c``, called directly whatever the
rows) and ``tiles`` (``amx_half.linear_float_x``: ``amx_half_weight_linear`` of ``csrc/amx_half.c``, x split
exactly into three bfloat16) are timed in turn within each run, one thread, by the process's CPU time (a
shared machine), each on a different one of ``--weights`` random weights cycled so that it comes from
memory (``--weights 1``: the same weight, from cache where it fits). Milliseconds per call (medians of
``--runs``) and the ratio gemv / tiles (above 1: the tiles are faster). Needs a CPU with AMX-BF16.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pluginfer.backends.cpu import amx_half
from pluginfer.backends.cpu import half_linear as native_half_linear
from pluginfer.backends.cpu.replay import _lib


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="32000x1024", help="OUTxIN of the weight")
    parser.add_argument("--dtype", choices=["float16", "bfloat16"], default="float16")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 12, 16, 24])
    parser.add_argument("--weights", type=int, default=4, help="distinct weights cycled")
    parser.add_argument("--runs", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if amx_half.library() is None:
        raise SystemExit("no AMX bfloat16 tiles here (the log line says why)")
    n, k = (int(v) for v in args.shape.split("x"))
    dtype = getattr(torch, args.dtype)
    code = native_half_linear.HALF_LINEAR_DTYPES[dtype]
    weights = [torch.randn(n, k).to(dtype) for _ in range(args.weights)]
    print(f"{n}x{k} {args.dtype}, {args.weights} weight(s) cycled, one thread, CPU time, medians of {args.runs}")
    print("rows  gemv ms  tiles ms  gemv/tiles")
    for rows in args.rows:
        x = torch.randn(rows, k)
        out = torch.empty(rows, n)
        gemv, tiles = [], []
        for run in range(args.runs):
            weight = weights[run % len(weights)]
            start = time.process_time()
            status = _lib().half_weight_linear(code, x.data_ptr(), rows, k, weight.data_ptr(), n, None, out.data_ptr())
            gemv.append(time.process_time() - start)
            if status != 0:
                raise SystemExit(f"half_weight_linear: status {status}")
            weight = weights[(run + len(weights) // 2) % len(weights)]
            start = time.process_time()
            amx_half.linear_float_x(x, weight)
            tiles.append(time.process_time() - start)
        g, t = statistics.median(gemv) * 1e3, statistics.median(tiles) * 1e3
        print(f"{rows:4d}  {g:7.2f}  {t:8.2f}  {g / t:9.2f}x", flush=True)


if __name__ == "__main__":
    main()
