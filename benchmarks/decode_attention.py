"""Paged decode attention (float32), the native kernel of a git revision against the working tree's.

Both sources of ``pluginfer/backends/cpu/csrc/attention.c`` are compiled here with native_build.py's flags into
two libraries loaded side by side, then called in turn within each run on the same inputs (one thread,
CPU time of the calling thread, medians). By default the shape of ``benchmarks/vs_llamacpp.py``'s
0.5B-shaped llama: 16 query heads over 8 KV heads of 64, blocks of 16 positions, and one cache per layer
(24 layers), so each call reads its layer's keys and values from memory as a decode step does.

    python benchmarks/decode_attention.py --before HEAD~1 --batches 1 16 --contexts 128 256 512 1024
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from pluginfer.backends.cpu import build as native_build

SOURCE = Path(native_build.__file__).with_name("csrc") / "attention.c"


def build(source_text: str, work: Path, name: str) -> ctypes.CDLL:
    source, target = work / f"{name}.c", work / f"{name}.so"
    source.write_text(source_text)
    subprocess.run(["cc", *native_build.FLAGS, native_build.OPENMP_FLAG, f"-I{SOURCE.parent}", str(source), "-o", str(target), "-lm"], check=True)
    library = ctypes.CDLL(str(target))
    library.paged_decode_attention.restype = ctypes.c_int
    library.paged_decode_attention.argtypes = ([ctypes.c_void_p] * 6 + [ctypes.c_int64] * 7
                                               + [ctypes.c_float, ctypes.c_int64, ctypes.c_float])
    return library


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", default="HEAD", help="git revision of the 'before' kernel (default HEAD)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 256, 512, 1024])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=24,
                        help="distinct caches called in turn (fewer where they would pass --memory-mb)")
    parser.add_argument("--memory-mb", type=int, default=512, help="at most this much cache in all")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()

    torch.set_num_threads(1)
    repo = SOURCE.parents[4]
    before_text = subprocess.run(["git", "show", f"{args.before}:pluginfer/backends/cpu/csrc/attention.c"], cwd=repo,
                                 check=True, capture_output=True, text=True).stdout
    with tempfile.TemporaryDirectory() as tmp:
        libraries = {"before": build(before_text, Path(tmp), "before"),
                     "after": build(SOURCE.read_text(), Path(tmp), "after")}
        print(f"{args.heads} heads / {args.kv_heads} KV heads of {args.head_dim}, blocks of {args.block_size}, "
              f"{args.layers} caches; one thread, CPU time, median of {args.runs}; before = {args.before}")
        print("| batch | context | caches | before ms / call | after ms / call | before / after | after GB/s |")
        print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for batch in args.batches:
            for context in args.contexts:
                row(libraries, batch, context, args)


def row(libraries: dict[str, ctypes.CDLL], batch: int, context: int, args: argparse.Namespace) -> None:
    generator = torch.Generator().manual_seed(0)
    per_seq = -(-context // args.block_size)
    blocks = batch * per_seq
    shape = (blocks, args.block_size, args.kv_heads, args.head_dim)
    layer_bytes = 2 * 4 * blocks * args.block_size * args.kv_heads * args.head_dim
    layers = max(1, min(args.layers, args.memory_mb * 2**20 // layer_bytes))
    caches = [(torch.randn(shape, generator=generator), torch.randn(shape, generator=generator))
              for _ in range(layers)]
    tables = torch.randperm(blocks, generator=generator).reshape(batch, per_seq)
    lens = torch.full((batch,), context, dtype=torch.int64)
    query = torch.randn(batch, args.heads, args.head_dim, generator=generator)
    outs = {name: torch.empty(batch, args.heads, args.head_dim) for name in libraries}

    def call(library: ctypes.CDLL, keys: torch.Tensor, values: torch.Tensor, out: torch.Tensor) -> None:
        status = library.paged_decode_attention(
            query.data_ptr(), keys.data_ptr(), values.data_ptr(), tables.data_ptr(), lens.data_ptr(),
            out.data_ptr(), batch, args.heads, args.kv_heads, args.head_dim, args.head_dim, args.block_size,
            per_seq, args.head_dim ** -0.5, 0, 0.0)
        assert status == 0

    times: dict[str, list[float]] = {name: [] for name in libraries}
    for _ in range(args.runs):
        for name, library in libraries.items():
            start = time.thread_time()
            for keys, values in caches:
                call(library, keys, values, outs[name])
            times[name].append((time.thread_time() - start) / len(caches) * 1e3)
    torch.testing.assert_close(outs["after"], outs["before"], atol=2e-5, rtol=2e-5)  # the last cache's
    before, after = (statistics.median(times[name]) for name in ("before", "after"))
    read = 2 * 4 * batch * context * args.kv_heads * args.head_dim  # the keys and values attended to
    print(f"| {batch} | {context} | {layers} | {before:.4f} | {after:.4f} | {before / after:.2f}x | "
          f"{read / after / 1e6:.1f} |")


if __name__ == "__main__":
    main()
