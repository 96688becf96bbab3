"""One recorded decode step replayed by two builds of the native library in one process, A/B at fine grain.

    python benchmarks/replay_ab.py MODEL --before /tmp/before [--batch 1] [--threads 1 2] [--rounds 400]

The step is recorded with this checkout (``cpu_step_replay``, as the engine records it); the same program (its
entries are op codes and addresses of tensors, no function addresses at batch 1 and at batch 16 without AMX
tiles) is then run by this checkout's ``step_replay`` and by the one built from ``--before``'s
``pluginfer/backends/cpu/csrc`` (loaded apart, RTLD_LOCAL: each library calls its own kernels). Rounds alternate
library (which one goes first, too) and thread count every ``--steps`` replays, so that both builds meet the same
noise on a shared machine; reported: the 10th percentile and the median of the per-step wall clock and CPU time
(the process's, all threads) over the rounds, and the ratio this / before. The forks a step makes (regions run on
more than one thread) are counted through ``benchmarks/omp_count.c``.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from replay_entries import load_counter, recorded_step  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--before", type=Path, required=True, help="a source tree (git archive of a commit)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--rounds", type=int, default=400)
    parser.add_argument("--steps", type=int, default=20, help="replays per sample")
    args = parser.parse_args()

    counter = load_counter()
    import torch

    from pluginfer.backends.cpu import build as native_build
    from pluginfer.backends.cpu import library as native_library

    llm, recorded = recorded_step(args.model, args.batch)  # llm keeps the recording's tensors alive
    if recorded is None:
        return 1
    program = recorded[0].program
    if "quant_matmul_at" in recorded[0].names or "half_linear_at" in recorded[0].names:
        print("the step calls another library's kernel by address: not comparable", file=sys.stderr)
        return 1
    sources = tuple(args.before / "pluginfer" / "backends" / "cpu" / "csrc" / path.name for path in native_library.SOURCES)
    before, _, _ = native_build.build_library("cpu_kernels_before", sources)
    libraries = {"before": before, "this": native_library.load()}
    status = ctypes.c_int64(0)
    forks = ctypes.c_int64.in_dll(counter, "omp_count_forks")
    for library in libraries.values():
        library.step_replay.restype = ctypes.c_int64
        library.step_replay.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]

    def run(library: ctypes.CDLL, steps: int) -> None:
        for _ in range(steps):
            if library.step_replay(program.data_ptr(), program.numel(), ctypes.addressof(status)):
                raise RuntimeError(f"replay failed: status {status.value}")

    torch.set_num_threads(max(args.threads))
    for name, library in libraries.items():
        forks.value = 0
        run(library, 1)
        print(f"{name}: {forks.value} forks a step at {max(args.threads)} threads")
    print(f"model {args.model}, batch {args.batch}, {len(recorded[0].names)} entries; load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    samples: dict[tuple[str, int], list[float]] = {}
    for round_ in range(args.rounds):
        for threads in args.threads:
            torch.set_num_threads(threads)
            run(libraries["this"], 2)  # the team at this size before the clock starts
            order = list(libraries.items())
            for name, library in order[::-1] if round_ % 2 else order:  # which goes first alternates too
                started, cpu = time.perf_counter(), time.process_time()
                run(library, args.steps)
                samples.setdefault((name, threads), []).append((time.perf_counter() - started) / args.steps * 1e3)
                samples.setdefault((name, -threads), []).append((time.process_time() - cpu) / args.steps * 1e3)
    print(f"ms per replayed step, {args.rounds} samples of {args.steps} (p10 / median); load average now "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for threads in args.threads:
        for clock, key in (("wall", threads), ("CPU", -threads)):
            figures = {}
            for name in libraries:
                values = sorted(samples[(name, key)])
                figures[name] = (values[len(values) // 10], statistics.median(values))
            print(f"{threads} thread(s), {clock:4s}: before {figures['before'][0]:.4f} / {figures['before'][1]:.4f}, "
                  f"this {figures['this'][0]:.4f} / {figures['this'][1]:.4f}, this / before "
                  f"{figures['this'][0] / figures['before'][0]:.3f}x / {figures['this'][1] / figures['before'][1]:.3f}x")
    llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
