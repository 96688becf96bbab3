"""KV cache dtypes side by side on the cpu backend: tokens a cache of the same bytes holds, and the speed of one
decode step's attention (write this step's keys and values, then attend) over a long context.

    python benchmarks/kv_cache_dtype.py                      # Qwen2.5-0.5B's cache: 24 layers, 14 heads, 2 KV heads x 64
    python benchmarks/kv_cache_dtype.py --batch 16 --context 2048 --dtypes float16 int8 fp8

The query is float32 (a float32 model: its float16 cache is read by the kv16 kernel, widened as loaded). Each
run times every layer's call once; runs alternate between the dtypes and the median of each is reported.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pluginfer.backends.cpu.backend import CpuBackend
from pluginfer.core.protocols import KVCacheSpec
from pluginfer.engine.plan import resolve_dtype
from pluginfer.layers.kv_quant import QUANTIZED_KV_DTYPES
from pluginfer.testing import backend_contract

BLOCK = 16


def _dtype(name: str) -> torch.dtype:
    return QUANTIZED_KV_DTYPES.get(name) or resolve_dtype(name, {})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--heads", type=int, default=14)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--dtypes", nargs="+", default=["float16", "int8", "fp8", "fp8_e5m2"])
    args = parser.parse_args()
    spec = KVCacheSpec(args.layers, args.kv_heads, args.head_dim)
    backend = CpuBackend()
    per_seq = -(-args.context // BLOCK)
    tables = [list(range(s * per_seq, (s + 1) * per_seq)) for s in range(args.batch)]
    batch = backend_contract.paged_batch(torch.device("cpu"), tables, [args.context] * args.batch, [1] * args.batch,
                                         BLOCK)
    batch.attention = backend.prepare(batch)
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(args.batch, args.heads, args.head_dim, generator=generator)
    key = torch.randn(args.batch, args.kv_heads, args.head_dim, generator=generator)
    caches, times = {}, {name: [] for name in args.dtypes}
    for name in args.dtypes:
        layers = backend.allocate_kv_cache(spec, args.batch * per_seq, BLOCK, _dtype(name))
        history = backend_contract.paged_batch(torch.device("cpu"), tables, [args.context] * args.batch,
                                               [args.context - 1] * args.batch, BLOCK)
        values = torch.randn(history.slot_mapping.shape[0], args.kv_heads, args.head_dim, generator=generator)
        for pair in layers:  # every earlier position written, as prefill steps would have
            _fill(pair, history, values)
        caches[name] = layers
    for _ in range(args.runs):
        for name in args.dtypes:
            started = time.perf_counter()
            for pair in caches[name]:
                backend.paged_attention(query, key, key, pair, batch, args.head_dim ** -0.5)
            times[name].append(time.perf_counter() - started)
    base = statistics.median(times[args.dtypes[0]])
    print(f"batch {args.batch} x context {args.context}, {args.layers} layers, {args.heads} heads / "
          f"{args.kv_heads} KV heads x {args.head_dim}; threads {torch.get_num_threads()}")
    print("| KV cache dtype | bytes per token | tokens per GiB | decode attention ms / step (all layers) | tokens/s | vs first |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name in args.dtypes:
        median = statistics.median(times[name])
        per_token = spec.bytes_per_token(_dtype(name))
        print(f"| {name} | {per_token} | {2**30 // per_token} | {median * 1e3:.1f} | {args.batch / median:.0f} "
              f"| {base / median:.2f}x |")


def _fill(pair: tuple, history: object, values: torch.Tensor) -> None:
    """Every earlier position's key and value, written by the reference write."""
    from pluginfer.layers import attention_ops

    attention_ops.write_kv(values, values, pair[0], pair[1], history.slot_mapping)


if __name__ == "__main__":
    main()
