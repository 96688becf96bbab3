"""Every branch of the cpu backend's C kernels runs, at one thread and at several, on non-finite inputs too,
and the native path is really the one taken.

- Decode attention (``csrc/attention.c``) goes multi-threaded above 2**20 multiply-adds
  (``total_len * num_heads * (head_dim + v_dim)``); with fewer sequences than threads it splits each
  sequence's KV heads between threads (``splits = ceil(threads / seqs)``, capped at the KV heads). Cases above
  the threshold, at 1, 2 and 4 threads, equal a float64 reference and equal the one-thread result bit for bit
  (a head's arithmetic does not depend on which task computes it). A subprocess watches the OpenMP worker
  thread: it exists and does a share of the work only when the threaded, head-splitting branch runs.
- The kernels' OpenMP runtime is torch's: ``torch.set_num_threads`` sets the threads they use (asserted).
- NaN and Inf: tests/backends/test_native_nonfinite.py.
- Each kernel returns a result (not None: "use the torch path") for every input it claims to handle, and a
  float32 engine step runs every native family (counted by tests/native_usage.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from pluginfer.backends.cpu import backend as cpu
from pluginfer.backends.cpu import layer_ops as native_layer_ops
from pluginfer.backends.cpu import library as native_library
from pluginfer.backends.cpu import ops as native
from pluginfer.backends.cpu import panels as native_panels
from pluginfer.quant import ggml_ops, int4, packing  # noqa: F401  (they define the dequantize ops)
from tests import native_usage
from tests.backends.paged import attention_reference, paged_inputs

REPO = Path(__file__).resolve().parents[2]
THRESHOLD = 1 << 20  # attention.c: parallel = total_len * num_heads * (head_dim + v_dim) > (1 << 20)

pytestmark = pytest.mark.usefixtures("native_kernels")


def avx512() -> bool:
    return bool(native_library.load().panel_linear_supported())


def openmp() -> bool:
    return native_library.loaded_build["info"].openmp


# --------------------------------------------------------------------------------------------------
# The library loads where it can


def test_the_native_library_loads_where_this_machine_can_build_it() -> None:
    assert native.available() is None  # the module's fixture skipped otherwise: a failure on a capable machine
    flags = native_usage.cpu_flags()
    if "avx512f" in flags:
        assert avx512() and native.op("panel_linear") is not None and native.op("pack_panels") is not None
    library = native_library.load()
    if hasattr(library, "quant_dot_supported") and not native_usage.missing_flags(native_usage.FUSED):
        assert library.quant_dot_supported()
    for name in ("rms_norm", "silu_and_mul", "rotary_neox", "ggml_dequantize", "grouped_dequantize",
                 "int4_dequantize"):
        assert cpu.build().op(name) is not None, name


# --------------------------------------------------------------------------------------------------
# Decode attention: the threaded branch


# (seq_lens, heads, kv_heads, head_dim, v_dim, sliding_window, soft_cap): each above the threshold.
THREADED = {
    "one-seq-avx512": ([1100], 8, 4, 64, 64, None, None),
    # 5 KV heads at 4 threads: 4 splits of 2 heads, the last task empty (kv_begin >= kv_end).
    "one-seq-5-kv-heads": ([1700], 10, 5, 64, 64, None, None),
    "two-seqs-5-kv-heads": ([900, 700], 10, 5, 64, 64, None, None),
    "portable-loop-window": ([2000], 8, 2, 40, 40, 700, None),  # dims not multiples of 16
    "soft-cap-multi-head": ([1200], 8, 8, 64, 64, None, 30.0),  # a soft cap takes the portable loop
    "multi-query": ([1100], 8, 1, 64, 64, None, None),  # one KV head: nothing to split
    "value-dim-differs": ([1400], 8, 2, 64, 32, 1000, None),
}


@pytest.mark.parametrize("case", list(THREADED))
@pytest.mark.parametrize("threads", [1, 2, 4], indirect=True, ids=lambda n: f"{n}-thread")
def test_decode_attention_above_the_threading_threshold(case: str, threads: int) -> None:
    seq_lens, heads, kv_heads, head_dim, v_dim, window, soft_cap = THREADED[case]
    assert sum(seq_lens) * heads * (head_dim + v_dim) > THRESHOLD  # the threaded branch, when threads > 1
    assert len(seq_lens) < 4  # fewer sequences than (some) threads: heads split between threads
    query, key_cache, value_cache, tables = paged_inputs(seq_lens, heads, kv_heads, head_dim, v_dim, seed=len(case))
    scale = head_dim ** -0.5
    lens = torch.tensor(seq_lens)
    out = native_layer_ops.paged_decode_attention(query, key_cache, value_cache, tables, lens, scale, window, soft_cap)
    expected = attention_reference(query, key_cache, value_cache, tables, seq_lens, scale, window, soft_cap)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=2e-5)
    torch.set_num_threads(1)
    single = native_layer_ops.paged_decode_attention(query, key_cache, value_cache, tables, lens, scale, window, soft_cap)
    torch.set_num_threads(threads)
    assert torch.equal(out, single), "a head's output depends on how the heads were split between threads"


def regrouped(key_cache: torch.Tensor, value_cache: torch.Tensor, tables: torch.Tensor, seq_lens: list[int],
              group: int, block_size: int) -> tuple[torch.Tensor, ...]:
    """The same keys and values as one KV head per query head (each KV head repeated ``group`` times), in
    blocks of ``block_size`` positions laid out in reverse order."""
    old_block, kv_heads = key_cache.shape[1], key_cache.shape[2]
    per_seq = -(-max(seq_lens) // block_size)
    num_blocks = len(seq_lens) * per_seq
    new_tables = torch.arange(num_blocks - 1, -1, -1).reshape(len(seq_lens), per_seq)
    caches = []
    for cache in (key_cache, value_cache):
        flat = cache.new_full((num_blocks * block_size, kv_heads * group, cache.shape[-1]), float("nan"))
        for s, length in enumerate(seq_lens):
            positions = torch.arange(length)
            old = tables[s, positions // old_block] * old_block + positions % old_block
            new = new_tables[s, positions // block_size] * block_size + positions % block_size
            flat[new] = cache.reshape(-1, kv_heads, cache.shape[-1])[old].repeat_interleave(group, 1)
        caches.append(flat.reshape(num_blocks, block_size, kv_heads * group, cache.shape[-1]))
    return caches[0], caches[1], new_tables


@pytest.mark.skipif(not avx512(), reason="the blocked AVX-512 path (the portable loop is per head already)")
@pytest.mark.parametrize(("heads", "kv_heads", "v_dim"), [
    (16, 8, 64),  # group 2: query heads in pairs for the scores, values 2 heads x 4 registers
    (12, 2, 48),  # group 6: values 4 + 2 heads, 3 registers
    (10, 2, 80),  # group 5: values 4 + 1 heads, 4 + 1 registers
    (9, 3, 16),  # group 3 (odd: scores a head at a time), one register
    (32, 4, 128),  # group 8: two blocks of 4 heads, two passes of 4 registers
])
@pytest.mark.parametrize("window", [None, 21])  # a window starts mid-block: chunks straddle blocks
def test_decode_attention_blocking_is_bit_invariant(heads: int, kv_heads: int, v_dim: int,
                                                    window: int | None) -> None:
    """The AVX-512 kernel processes query heads that share a KV head together (pairs for the scores, up to 4
    for the values) and walks positions in chunks of 8 or 16 through the block table. Expected: the float64
    reference within 2e-5, and bit-for-bit the output of the same keys and values given as one KV head per
    query head (group 1: one head at a time) in blocks of 5 positions, i.e. every output element is the
    same sum in the same order however heads and positions are blocked."""
    seq_lens = [1, 7, 8, 9, 16, 17, 40, 150]
    query, key_cache, value_cache, tables = paged_inputs(seq_lens, heads, kv_heads, 64, v_dim, seed=heads)
    lens, scale = torch.tensor(seq_lens), 0.125
    out = native_layer_ops.paged_decode_attention(query, key_cache, value_cache, tables, lens, scale, window, None)
    expected = attention_reference(query, key_cache, value_cache, tables, seq_lens, scale, window)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=2e-5)
    keys, values, per_head_tables = regrouped(key_cache, value_cache, tables, seq_lens, heads // kv_heads, 5)
    per_head = native_layer_ops.paged_decode_attention(query, keys, values, per_head_tables, lens, scale, window, None)
    assert torch.equal(out, per_head)


WATCH = textwrap.dedent("""
    import json, os, sys, threading, time
    import numpy as np
    import torch
    from pluginfer.backends.cpu import ops as native, layer_ops as native_layer_ops, library as native_library, panels as native_panels

    def tasks():
        return set(os.listdir("/proc/self/task"))

    def cpu_ns(task):
        with open(f"/proc/self/task/{task}/schedstat") as f:
            return int(f.read().split()[0])

    torch.set_num_threads(int(sys.argv[1]))
    native_library.load()
    rng = np.random.default_rng(0)

    def case(length, heads=32, kv_heads=2, dim=128, block_size=16):
        # numpy-made inputs: no torch op runs (and wakes torch's own OpenMP threads) before the kernel.
        blocks = -(-length // block_size)
        cache = lambda: torch.from_numpy(rng.standard_normal((blocks, block_size, kv_heads, dim), dtype=np.float32))
        tables = torch.from_numpy(np.arange(blocks, dtype=np.int64)[None])
        query = torch.from_numpy(rng.standard_normal((1, heads, dim), dtype=np.float32))
        return query, cache(), cache(), tables, torch.from_numpy(np.array([length], dtype=np.int64))

    def run(inputs, times):
        # CPU time: this thread's from its clock (schedstat lags for a running thread), the others' (asleep
        # when read) from schedstat.
        first_tasks, me = tasks(), str(threading.get_native_id())
        shared = 0  # calls in which this thread and another each did a fifth of the call's CPU time or more
        for _ in range(times):
            before, mine = {task: cpu_ns(task) for task in tasks() - {me}}, time.thread_time_ns()
            native_layer_ops.paged_decode_attention(*inputs, 0.1, None, None)
            mine = time.thread_time_ns() - mine
            others = [cpu_ns(task) - before.get(task, 0) for task in tasks() - {me}]
            total = mine + sum(others)
            shared += total > 0 and mine >= 0.2 * total and max(others, default=0) >= 0.2 * total
        return {"new_threads": len(tasks() - first_tasks), "shared_calls": shared, "calls": times}

    small = case(64)  # 64 * 32 * 256 = 2**19 multiply-adds: below the threshold
    large = case(65536)  # 2**29: above it, one sequence, two tasks of ~10 ms (128 MB of cache)
    print(json.dumps({"small": run(small, 20), "large": run(large, 8)}))
""")


def watch_threads(threads: int) -> dict:
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "OMP_WAIT_POLICY": "passive", "PYTHONPATH": path}
    result = subprocess.run([sys.executable, "-c", WATCH, str(threads)], capture_output=True, text=True,
                            env=env, timeout=300, cwd=REPO)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="per-thread CPU time is read from Linux /proc")
def test_the_threaded_branch_splits_one_sequences_heads_between_threads() -> None:
    """One sequence above the threshold at 2 threads: an OpenMP worker thread appears, and in most calls both
    threads work on the sequence (its 2 KV heads are split in two tasks). Were the sequence one task, one
    thread would do each call alone: idle workers sleep under OMP_WAIT_POLICY=passive, so a thread without
    a task has next to no CPU time in that call. Below the threshold, or at one thread, no worker runs."""
    if not openmp():
        pytest.skip("the library was built without OpenMP (single-threaded by design)")
    two = watch_threads(2)
    assert two["small"]["new_threads"] == 0, two  # below the threshold: not worth waking a thread
    large = two["large"]
    assert large["new_threads"] >= 1, f"the threaded branch never ran: {two}"
    # Two tasks of ~10 ms each: long enough for a worker woken late on a busy machine to take the second
    # one (with shorter tasks the first thread to run often takes both). Half the calls leaves room still.
    assert large["shared_calls"] >= large["calls"] // 2, f"heads were not split between threads: {two}"
    one = watch_threads(1)
    assert one["large"]["new_threads"] == 0, one


# --------------------------------------------------------------------------------------------------
# The native path is the one taken


@pytest.mark.parametrize("shape", [(5, 64), (2, 3, 96)])
def test_each_kernel_handles_the_inputs_it_claims(shape: tuple[int, ...]) -> None:
    """float32, float16 and bfloat16 contiguous inputs, any leading dims: every kernel answers (None would
    mean 'take the torch path'). What they decline, by design: strided inputs where the kernel reads rows
    contiguously."""
    x = torch.randn(*shape)
    weight = torch.randn(shape[-1])
    for residual in (None, torch.randn(*shape)):
        for offset in (0.0, 1.0):
            assert native_layer_ops.rms_norm(x, residual, weight, 1e-5, offset) is not None, (residual is not None, offset)
    assert native_layer_ops.silu_and_mul(torch.randn(*shape[:-1], 2 * shape[-1])) is not None
    packed = native_panels.pack_panels(torch.randn(20, shape[-1])) if avx512() else None
    if packed is not None:
        assert native_panels.panel_linear(x, packed, 20).shape == (*shape[:-1], 20)
    for dtype in (torch.bfloat16, torch.float16):  # 16-bit: tests/backends/test_native_half_ops.py
        assert native_layer_ops.rms_norm(x.to(dtype), None, weight.to(dtype), 1e-5, 0.0) is not None
        assert native_layer_ops.silu_and_mul(torch.randn(*shape[:-1], 2 * shape[-1]).to(dtype)) is not None
    assert native_layer_ops.rms_norm(x.transpose(0, -1), None, weight[: shape[0]], 1e-5, 0.0) is None


def test_a_float32_engine_runs_every_native_family(tiny_llama_checkpoint: tuple[Path, object]) -> None:
    """A float32 tiny llama, prefill and decode: RMSNorm, rotary, SiLU-and-mul, decode attention and (on an
    AVX-512 CPU) the panel GEMM each run natively; a layer that silently fell back to torch would not count."""
    from pluginfer import LLM, SamplingParams

    before = {family: native_usage.ran(family) for family in native_usage.FAMILIES}
    llm = LLM(model=str(tiny_llama_checkpoint[0]), dtype="float32", num_blocks=32, block_size=8)
    llm.generate([[5, 6, 7, 8, 9], [10, 11, 12]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    ran = {family: native_usage.ran(family) - before[family] for family in native_usage.FAMILIES}
    expected = ["decode attention", "RMSNorm", "SiLU-and-mul", "rotary (neox)"]
    if avx512():
        expected.append("panel GEMM (AVX-512)")
    assert all(ran[family] > 0 for family in expected), ran
