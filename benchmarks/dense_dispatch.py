"""Per-call cost of ``layers.dense.DenseMatmul.linear`` (the kernel-table dispatch of the cpu backend's layouts).

    python benchmarks/dense_dispatch.py

One thread, timed by CPU time (a shared machine's other load does not count); a 64x64 weight isolates the
Python overhead, a 1024x1024 one shows the kernel. Medians of 7 timings of 2000 (200) calls. To compare two
commits, run it with ``PYTHONPATH`` set to a ``git archive`` of each, alternating processes.
"""

from __future__ import annotations

import statistics
import time

import torch

from pluginfer.backends.cpu import backend as cpu
from pluginfer.layers import dense


def main() -> None:
    torch.set_num_threads(1)
    backend = cpu.build()
    for batched, rows, size in ((False, 1, 64), (True, 16, 64), (False, 1, 1024), (True, 16, 1024)):
        matmul = dense.DenseMatmul(backend, batched)
        layout, weight = matmul.relayout(torch.randn(size, size))
        x = torch.randn(rows, size)
        calls = 2000 if size == 64 else 200
        samples = []
        for _ in range(7):
            start = time.process_time()
            for _ in range(calls):
                matmul.linear(layout, x, weight, None, size)
            samples.append((time.process_time() - start) / calls * 1e6)
        print(f"{layout:>10} {rows:>3} rows {size}x{size}: {statistics.median(samples):8.2f} us per call")


if __name__ == "__main__":
    main()
