"""The float32 matmuls of one decoder layer: the native panel kernel vs oneDNN's prepacked GEMM vs MKL.

    python benchmarks/dense_gemm.py                       # 0.5B llama layer shapes, rows 1 16 32 128 512
    python benchmarks/dense_gemm.py --rows 1 16 --copies 8

Each layer's four linears (qkv, o, gate_up, down) are timed as the engine calls them
(``backends/cpu_dense.py``): ``panels`` (``pack_panels`` + ``panel_linear``), ``onednn``
(``torch.ops.mkldnn`` prepacked) and ``mkl`` (``x @ W`` on ``[in, out]``, MKL's GEMV/GEMM).
``--copies`` distinct weights of each shape are cycled so they come from memory, as in a decode
step, not from cache. Milliseconds per layer, medians of ``--runs`` timings, and each layout's
speed relative to ``panels``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from pluginfer.backends.cpu import onednn
from pluginfer.backends.cpu import ops as native
from pluginfer.backends.cpu import panels as native_panels


def layer_shapes(hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int) -> list[tuple[int, int]]:
    """(out, in) of qkv, o, gate_up and down."""
    return [((heads + 2 * kv_heads) * head_dim, hidden), (hidden, heads * head_dim),
            (2 * intermediate, hidden), (hidden, intermediate)]


def median_seconds(fn, runs: int) -> float:
    fn()
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 32, 128, 512])
    parser.add_argument("--copies", type=int, default=24, help="distinct weights per shape (24: a 0.5B model's layers)")
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    if native.available() is not None or native.op("panel_linear") is None:
        print("the native panel kernel is unavailable here (needs a C compiler and an AVX-512 CPU)")
        return 1
    if not onednn.available():
        print("this torch build has no oneDNN")
        return 1

    shapes = layer_shapes(args.hidden, args.intermediate, args.heads, args.kv_heads, args.head_dim)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; shapes (out, in) {shapes}, "
          f"{args.copies} copies each; ms per layer, medians of {args.runs}")
    generator = torch.Generator().manual_seed(0)
    layouts: dict[str, list[list[torch.Tensor]]] = {"panels": [], "onednn": [], "mkl": []}
    for out_features, in_features in shapes:
        weights = [torch.randn(out_features, in_features, generator=generator) for _ in range(args.copies)]
        layouts["panels"].append([native_panels.pack_panels(w) for w in weights])
        layouts["onednn"].append([onednn.pack(w) for w in weights])
        layouts["mkl"].append([w.t().contiguous() for w in weights])
        del weights
    matmul = {
        "panels": lambda x, w, out_features: native_panels.panel_linear(x, w, out_features),
        "onednn": lambda x, w, out_features: onednn.linear(x, w, None),
        "mkl": lambda x, w, out_features: x @ w,
    }

    print(f"{'rows':>6}" + "".join(f"{name:>12}" for name in layouts) + "   onednn/panels   mkl/panels")
    for rows in args.rows:
        inputs = [torch.randn(rows, in_features, generator=generator) for _, in_features in shapes]
        per_layer = {}
        for name, weights in layouts.items():
            def run(name: str = name, weights: list[list[torch.Tensor]] = weights,
                    inputs: list[torch.Tensor] = inputs) -> None:
                for copy in range(args.copies):
                    for shape, (out_features, _) in enumerate(shapes):
                        matmul[name](inputs[shape], weights[shape][copy], out_features)
            per_layer[name] = median_seconds(run, args.runs) / args.copies
        print(f"{rows:>6}" + "".join(f"{per_layer[name] * 1e3:>12.3f}" for name in layouts)
              + f"{per_layer['onednn'] / per_layer['panels']:>15.2f}x{per_layer['mkl'] / per_layer['panels']:>12.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
