"""The OpenMP regions of one replayed decode step, and each entry's time at 1 and 2 threads.

    python benchmarks/replay_entries.py MODEL [--batch 1] [--rounds 7]    # a GGUF file or HF directory

A decode step of ``--batch`` sequences is recorded (``cpu_step_replay``) as the engine records it, then:

- the regions the step's replay opens, counted by ``benchmarks/omp_count.c`` (built here with gcc, loaded
  before the native library so that its ``GOMP_parallel`` calls go through the counter): every region, and
  the forks (regions run on more than one thread; a region whose ``if`` clause is false runs on one);
- each entry of the program alone in a hot loop (the entry repeated so that one ``step_replay`` call takes
  ~0.5 ms), at 1 and 2 threads, interleaved, the minimum and the median over ``--rounds`` rounds (on a shared
  machine the minimum is the kernel, the median adds the other processes): the entries whose 2-thread minimum
  is not below their 1-thread minimum are tiny work where a fork costs more than it saves;
- the whole step replayed in a loop at 1 and 2 threads, wall clock and CPU time.

Repeated entries compute on their own outputs (a residual add grows its sum): the figures are times only.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def load_counter() -> ctypes.CDLL:
    """benchmarks/omp_count.c built and loaded RTLD_GLOBAL (before the native library is loaded)."""
    built = Path(tempfile.gettempdir()) / f"pluginfer-omp-count-{os.getuid()}.so"
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", str(HERE / "omp_count.c"), "-o", str(built), "-ldl"],
                   check=True)
    return ctypes.CDLL(str(built), mode=ctypes.RTLD_GLOBAL)


def entries(program: list[int]) -> list[list[int]]:
    """The program cut into its entries [op, count, arguments...]."""
    out, at = [], 0
    while at < len(program):
        count = program[at + 1]
        out.append(program[at:at + 2 + count])
        at += 2 + count
    return out


def describe(name: str, entry: list[int]) -> str:
    a = entry[2:]
    if name == "quant_matmul":
        return f"type {a[0]} m {a[2]} k {a[3]} n {a[5]}"
    if name == "quant_matmul_at":
        return f"type {a[1]} m {a[3]} k {a[4]} n {a[6]} (amx)"
    if name.startswith("paged_decode_attention"):
        return f"seqs {a[6]} heads {a[7]}/{a[8]} dim {a[9]}"
    if name in ("rms_norm", "silu_and_mul", "rms_norm_16", "silu_and_mul_16"):
        return f"rows {a[4] if name.startswith('rms') else a[2]} cols {a[5] if name.startswith('rms') else a[3]}"
    return ""


def recorded_step(model: str, batch: int) -> tuple[object, list | None]:
    """An engine on ``model`` that has recorded its decode step of ``batch`` sequences, and that recording
    (None, with a line on stderr, where the step runs eagerly). Keep the engine while the recording is used."""
    from pluginfer import LLM, SamplingParams

    extra = {} if model.endswith(".gguf") else {"dtype": "float32"}
    llm = LLM(model=model, max_model_len=512, max_num_seqs=max(16, batch), enable_prefix_caching=False,
              max_num_batched_tokens=2048, **extra)
    prompts = [list(range(100 + i, 132 + i)) for i in range(batch)]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    replay = llm.engine.executor.worker.decode_graphs
    recorded = replay.programs.get(batch) if replay is not None else None
    if recorded is None:
        print(f"no replayed step of {batch} sequences (eager here)", file=sys.stderr)
    return llm, recorded


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=200, help="replays per whole-step measurement")
    parser.add_argument("--whole-only", action="store_true", help="the region count and the whole step only")
    args = parser.parse_args()

    counter = load_counter()
    import torch

    from pluginfer.backends.cpu import library as native_library
    from pluginfer.backends.cpu.replay import REPLAY_OPS

    llm, recorded = recorded_step(args.model, args.batch)  # llm keeps the recording's tensors alive
    if recorded is None:
        return 1
    program = recorded[0]
    library = native_library.load()
    status = ctypes.c_int64(0)
    regions = ctypes.c_int64.in_dll(counter, "omp_count_regions")
    forks = ctypes.c_int64.in_dll(counter, "omp_count_forks")
    cut = entries(program.program.tolist())
    names = [REPLAY_OPS[entry[0] - 1] for entry in cut]

    def run(tensor: torch.Tensor) -> None:
        if library.step_replay(tensor.data_ptr(), tensor.numel(), ctypes.addressof(status)):
            raise RuntimeError(f"replay failed: status {status.value}")

    print(f"model {args.model}, batch {args.batch}: {len(cut)} entries; load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for threads in (1, 2):
        torch.set_num_threads(threads)
        regions.value = forks.value = 0
        program.run()
        print(f"{threads} thread(s): {regions.value} regions a step, {forks.value} of them forks")
    torch.set_num_threads(2)
    fork_of = []
    for entry in [] if args.whole_only else cut:
        forks.value = 0
        run(torch.tensor(entry, dtype=torch.int64))
        fork_of.append(forks.value)

    # each entry repeated so that one call takes ~0.5 ms at one thread
    torch.set_num_threads(1)
    repeated = []
    for entry in [] if args.whole_only else cut:
        single = torch.tensor(entry, dtype=torch.int64)
        run(single)
        started = time.perf_counter()
        for _ in range(5):
            run(single)
        once = (time.perf_counter() - started) / 5
        times = max(1, min(2000, int(0.5e-3 / max(once, 1e-7))))
        repeated.append((torch.tensor(entry * times, dtype=torch.int64), times))

    samples: dict[tuple[int, int], list[float]] = {}
    step_samples: dict[tuple[int, str], list[float]] = {}
    for _ in range(args.rounds):
        for threads in (1, 2):  # interleaved
            torch.set_num_threads(threads)
            for index, (tensor, times) in enumerate(repeated):
                started = time.perf_counter()
                run(tensor)
                samples.setdefault((index, threads), []).append((time.perf_counter() - started) / times * 1e6)
            wall, cpu = time.perf_counter(), time.process_time()
            for _ in range(args.steps):
                program.run()
            step_samples.setdefault((threads, "wall"), []).append((time.perf_counter() - wall) / args.steps * 1e3)
            step_samples.setdefault((threads, "cpu"), []).append((time.process_time() - cpu) / args.steps * 1e3)

    print(f"whole step (replay only, {args.rounds} rounds of {args.steps}; min / median): " + ", ".join(
        f"{t} thread(s) {min(step_samples[(t, 'wall')]):.3f} / {statistics.median(step_samples[(t, 'wall')]):.3f} ms "
        f"wall, {min(step_samples[(t, 'cpu')]):.3f} / {statistics.median(step_samples[(t, 'cpu')]):.3f} ms CPU"
        for t in (1, 2)))
    if args.whole_only:
        llm.close()
        return 0
    print(f"\n{'#':>4s} {'entry':24s} {'shape':36s} {'forks':>5s} {'1 thr min':>9s} {'2 thr min':>9s} {'2/1':>6s}"
          f" {'1 thr p50':>9s} {'2 thr p50':>9s}   (us)")
    by_name: dict[str, list[float]] = {}
    for index, (name, entry) in enumerate(zip(names, cut)):
        one, two = (min(samples[(index, t)]) for t in (1, 2))
        one_p50, two_p50 = (statistics.median(samples[(index, t)]) for t in (1, 2))
        totals = by_name.setdefault(name, [0, 0.0, 0.0, 0, 0])
        totals[0] += 1
        totals[1] += one
        totals[2] += two
        totals[3] += fork_of[index]
        totals[4] += two >= one
        flag = "  <- not faster" if two >= one else ""
        print(f"{index:4d} {name:24s} {describe(name, entry):36s} {fork_of[index]:5d} {one:9.2f} {two:9.2f} "
              f"{two / one:6.2f} {one_p50:9.2f} {two_p50:9.2f}{flag}")
    print(f"\nby entry (sums of the minima, us): {'count':>5s} {'forks':>5s} {'1 thr':>9s} {'2 thr':>9s} {'2/1':>6s}"
          f" {'not faster':>10s}")
    for name, (count, one, two, forked, slower) in sorted(by_name.items(), key=lambda item: -item[1][1]):
        print(f"{name:34s} {count:5d} {forked:5d} {one:9.1f} {two:9.1f} {two / one:6.2f} {slower:10d}")
    one = sum(v[1] for v in by_name.values())
    two = sum(v[2] for v in by_name.values())
    print(f"{'sum of entries':34s} {len(cut):5d} {sum(fork_of):5d} {one:9.1f} {two:9.1f} {two / one:6.2f}")
    llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
