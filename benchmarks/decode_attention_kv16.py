"""Paged decode attention of a float32 query over a float32 cache against the same over float16 and bfloat16
caches (``paged_decode_attention`` against ``paged_decode_attention_kv16``, the working tree's library), in turn
within each run on the same query and block tables: one thread, CPU time of the calling thread, medians. The
shape of ``benchmarks/vs_llamacpp.py``'s 0.5B-shaped llama by default (16 query heads over 8 KV heads of 64,
blocks of 16), one cache per layer (24 layers) so each call reads its layer's cache from memory.
``--stream-mb 9`` reads that many MB (a layer's weights: the 0.5B Q4_K_M file's 216 MB over 24 layers) between
the calls, untimed, as a decode step does: without it the 24 caches (~113 MB at batch 16, context 144, 16-bit)
can stay in this machine's L3 between rounds, and the kernel times are those of L3, not of memory.

    python benchmarks/decode_attention_kv16.py --batches 1 16 --contexts 160 256 512
    python benchmarks/decode_attention_kv16.py --batches 16 --contexts 144 --stream-mb 9
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from pluginfer.backends.cpu import layer_ops as native_layer_ops

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--contexts", type=int, nargs="+", default=[160, 256, 512])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--stream-mb", type=int, default=0, help="MB read between the calls (a layer's weights)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"{args.heads} heads / {args.kv_heads} KV heads of {args.head_dim}, blocks of {args.block_size}, "
          f"{args.layers} caches, {args.stream_mb} MB read between calls; one thread, CPU time, median of {args.runs}")
    streams = [torch.ones(args.stream_mb * 262144) for _ in range(args.layers)] if args.stream_mb else []
    print("| batch | context | float32 ms / call | float16 ms | bfloat16 ms | float16 / float32 | bfloat16 / float32 |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for batch in args.batches:
        for context in args.contexts:
            per_seq = -(-context // args.block_size)
            query = torch.randn(batch, args.heads, args.head_dim)
            tables = torch.randperm(batch * per_seq).view(batch, per_seq)
            lens = torch.full((batch,), context, dtype=torch.int64)
            shape = (batch * per_seq, args.block_size, args.kv_heads, args.head_dim)
            caches = {dtype: [(torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)) for _ in range(args.layers)]
                      for dtype in DTYPES}
            times: dict[torch.dtype, list[float]] = {dtype: [] for dtype in DTYPES}
            for _ in range(args.runs):
                for dtype, layers in caches.items():  # interleaved
                    spent = 0.0
                    for layer, (key_cache, value_cache) in enumerate(layers):
                        if streams:
                            streams[layer].sum()
                        start = time.thread_time()
                        native_layer_ops.paged_decode_attention(query, key_cache, value_cache, tables, lens,
                                                                args.head_dim ** -0.5, None, None)
                        spent += time.thread_time() - start
                    times[dtype].append(spent / args.layers * 1e3)
            f32, f16, bf16 = (statistics.median(times[dtype]) for dtype in DTYPES)
            print(f"| {batch} | {context} | {f32:.4f} | {f16:.4f} | {bf16:.4f} | {f16 / f32:.2f} | {bf16 / f32:.2f} |",
                  flush=True)


if __name__ == "__main__":
    main()
