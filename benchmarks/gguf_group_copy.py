"""Two ways to build a GGUF model's fused q/k/v and gate/up groups without keeping the file pages they came from.

    python benchmarks/gguf_group_copy.py FILE.gguf --runs 5

Each run is a fresh process that copies every layer's q, k, v and gate, up tensors (their raw blocks) into
groups, adjacent tensors of one GGML type together, as the gguf quant method does at load, one of three ways:
- ``map``: read through the file's mapping and ``torch.cat`` (the engine before issue 12's fix: the pages
  read stay resident);
- ``map+release``: the same, then ``release_file_pages`` on each source (``MADV_DONTNEED``: the engine now);
- ``pread``: ``os.preadv`` of each tensor's bytes straight into its rows of the group (the pages never
  enter the process).
Printed: seconds to build all groups, and the resident and peak memory the copies added (MB), medians. The
file is in the page cache after the first run; llama's q/k row reordering is left out (a copy either way).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

FUSED = (("attn_q", "attn_k", "attn_v"), ("ffn_gate", "ffn_up"))
WAYS = ("map", "map+release", "pread")


def memory_mb() -> tuple[float, float]:
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def copy_group(handle: object, parts: list, way: str) -> object:
    import torch

    from pluginfer.formats.gguf.checkpoint import release_file_pages

    if way == "pread":
        group = torch.empty(sum(part.data.shape[0] for part in parts), parts[0].data.shape[1], dtype=torch.uint8)
        view, at = memoryview(group.numpy()).cast("B"), 0
        for part in parts:
            assert os.preadv(handle.fileno(), [view[at:at + part.n_bytes]], part.data_offset) == part.n_bytes
            at += part.n_bytes
        return group
    sources = [torch.from_numpy(part.data) for part in parts]
    group = torch.cat(sources)
    if way == "map+release":
        for source in sources:
            release_file_pages(source)
    return group


def build_groups(path: str, way: str) -> dict:
    import torch  # noqa: F401  (imported before the clock starts)

    from pluginfer.formats.gguf.checkpoint import release_file_pages  # noqa: F401
    from pluginfer.formats.gguf.reader import GGUFFile

    file = GGUFFile(path)
    tensors = {t.name: t for t in file.tensors}
    blocks = sorted({int(name.split(".")[1]) for name in tensors if name.startswith("blk.")})
    rss, peak = memory_mb()
    groups = []
    start = time.perf_counter()
    with open(path, "rb") as handle:
        for block in blocks:
            for fused in FUSED:
                runs: list[list] = []  # adjacent tensors of one type form a group, as in the engine
                for name in fused:
                    part = tensors[f"blk.{block}.{name}.weight"]
                    if runs and runs[-1][0].tensor_type == part.tensor_type:
                        runs[-1].append(part)
                    else:
                        runs.append([part])
                for parts in runs:
                    if len(parts) > 1:
                        groups.append(copy_group(handle, parts, way))
    seconds = time.perf_counter() - start
    after_rss, after_peak = memory_mb()
    return {"seconds": seconds, "added_rss_mb": after_rss - rss, "added_peak_mb": after_peak - peak,
            "group_mb": sum(group.numel() for group in groups) / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("file")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--child", choices=WAYS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(build_groups(args.file, args.child)))
        return
    results: dict[str, list[dict]] = {way: [] for way in WAYS}
    for _ in range(args.runs):  # interleaved
        for way in WAYS:
            out = subprocess.run([sys.executable, __file__, args.file, "--child", way], capture_output=True,
                                 text=True, check=True)
            results[way].append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"{Path(args.file).name}: medians of {args.runs} runs, groups of {results['map'][0]['group_mb']:.0f} MB")
    print("way            seconds  added RSS MB  added peak MB")
    for way, runs in results.items():
        median = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
        print(f"{way:13s} {median['seconds']:8.3f} {median['added_rss_mb']:13.0f} {median['added_peak_mb']:14.0f}")


if __name__ == "__main__":
    main()
