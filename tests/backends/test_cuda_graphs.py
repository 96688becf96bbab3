"""Decode CUDA graphs of the cuda backend (``backends/cuda_graphs.py``): buckets, padding into static buffers
and replay bookkeeping, on the CPU.

No GPU here: a stand-in graph runs the captured function again on replay and writes its result into the
output tensor the capture returned, which is what a CUDA graph's replay does to its static output. The
capture of a real ``torch.cuda.CUDAGraph`` runs in ``test_cuda_engine.py``'s ``gpu`` target, where there is a GPU.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from pluginfer.backends.cuda_graphs import DecodeGraphs, bucket_for, capture_sizes
from pluginfer.core.batch import ForwardBatch


class EagerGraph:
    """Replays by running the captured function again into the static output tensor."""

    def __init__(self) -> None:
        self.fn: Callable[[], torch.Tensor] | None = None

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        self.fn = fn
        self.out = fn()
        return self.out

    def replay(self) -> None:
        self.out.copy_(self.fn())


class CaptureRulesGraph(EagerGraph):
    """An :class:`EagerGraph` whose capture refuses what a CUDA graph's capture refuses, as far as CPU tensors
    can show it: reading a tensor's value on the host (``.item()``, ``.tolist()``: a device sync) and making a
    tensor of more than one element from host data (``torch.tensor(list)``: a pageable copy to the device).
    A 0-dim host tensor passes: it reaches a GPU op as a scalar argument."""

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        from torch.utils._python_dispatch import TorchDispatchMode

        class Rules(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func is torch.ops.aten._local_scalar_dense.default:
                    raise RuntimeError("a host read of a tensor's value during the capture (a device sync)")
                if func is torch.ops.aten.lift_fresh.default and args[0].dim() > 0:
                    raise RuntimeError("a tensor made from host data during the capture (a pageable copy)")
                return func(*args, **(kwargs or {}))

        with Rules():
            return super().capture(fn)


def test_capture_sizes_are_vllms_buckets_up_to_max_num_seqs() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(16) == [1, 2, 4, 8, 16]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(64)[-3:] == [48, 56, 64]


@pytest.mark.parametrize(("num_seqs", "bucket"), [(1, 1), (2, 2), (3, 4), (5, 8), (9, 16), (17, 20), (21, None)])
def test_bucket_is_the_smallest_size_that_holds_the_batch(num_seqs: int, bucket: int | None) -> None:
    assert bucket_for(capture_sizes(20), num_seqs) == bucket


def decode_batch(tokens: list[int], seq_lens: list[int], tables: list[list[int]], block_size: int) -> ForwardBatch:
    count = len(tokens)
    positions = [n - 1 for n in seq_lens]
    slots = [table[p // block_size] * block_size + p % block_size for table, p in zip(tables, positions)]
    width = max(len(t) for t in tables)
    padded = [t + [0] * (width - len(t)) for t in tables]
    return ForwardBatch(
        input_ids=torch.tensor(tokens), positions=torch.tensor(positions), slot_mapping=torch.tensor(slots),
        query_start_loc=torch.arange(count + 1), seq_lens=torch.tensor(seq_lens), block_tables=torch.tensor(padded),
        logits_indices=torch.arange(count), query_lens=[1] * count, max_query_len=1, max_seq_len=max(seq_lens),
        block_size=block_size)


def toy_forward(calls: list[int]) -> Callable[[ForwardBatch], torch.Tensor]:
    """Hidden states that depend on every per-sequence input the graphs must carry (and only on them)."""
    def forward(batch: ForwardBatch) -> torch.Tensor:
        calls.append(batch.num_seqs)
        assert batch.attention.num_decodes == batch.num_seqs and batch.max_query_len == 1
        features = torch.stack([batch.input_ids, batch.positions, batch.slot_mapping, batch.seq_lens,
                                batch.block_tables.sum(dim=1)], dim=1).float()
        return features[batch.logits_indices] * 2.0
    return forward


def expected_rows(batch: ForwardBatch) -> torch.Tensor:
    return torch.stack([batch.input_ids, batch.positions, batch.slot_mapping, batch.seq_lens,
                        batch.block_tables.sum(dim=1)], dim=1).float() * 2.0


def test_replay_gives_each_real_row_its_own_result_and_pads_with_the_scratch_block() -> None:
    calls: list[int] = []
    graphs = DecodeGraphs(toy_forward(calls), torch.device("cpu"), max_num_seqs=8, max_blocks_per_seq=6,
                          block_size=4, scratch_block=40, graph_factory=EagerGraph)
    graphs.capture()
    assert sorted(graphs.graphs) == [1, 2, 4, 8]
    assert calls == [8, 8, 4, 4, 2, 2, 1, 1]  # a warm-up and a capture per bucket, largest first
    batch = decode_batch([11, 12, 13], [5, 9, 1], [[3, 7], [1, 2, 8], [5]], 4)
    out = graphs(batch)
    assert out.shape == (3, 5) and graphs.replays == 1
    assert torch.equal(out, expected_rows(batch))  # block tables widened with zeros keep their sums
    padding = 3  # bucket 4 holds the 3 sequences and one padding row in the scratch block
    assert graphs.slot_mapping[padding].item() == 40 * 4 and graphs.seq_lens[padding].item() == 1
    assert graphs.block_tables[padding].tolist() == [40] * 6
    # Later steps reuse the buffers: a smaller one reads only its bucket's rows; in a larger one the rows
    # past its sequences are padding again, whatever an earlier step left there.
    small = decode_batch([21], [2], [[9]], 4)
    assert torch.equal(graphs(small), expected_rows(small))
    larger = decode_batch([31, 32, 33, 34, 35], [3, 4, 5, 6, 7], [[2], [4], [6, 1], [8, 3], [9, 5]], 4)
    assert torch.equal(graphs(larger), expected_rows(larger)) and graphs.replays == 3
    assert graphs.input_ids[5:8].tolist() == [0, 0, 0] and graphs.slot_mapping[5:8].tolist() == [160] * 3


def test_per_step_values_cached_in_the_batch_are_computed_in_each_capture() -> None:
    """A layer that caches a per-step tensor in ``batch.extras`` (as rotary caches cos/sin of the positions) must
    see fresh extras in the capture: one carried over from the warm-up would be replayed with stale positions."""
    def forward(batch: ForwardBatch) -> torch.Tensor:
        if "doubled" not in batch.extras:
            batch.extras["doubled"] = batch.positions.float() * 2.0
        return batch.extras["doubled"][batch.logits_indices, None]

    graphs = DecodeGraphs(forward, torch.device("cpu"), max_num_seqs=2, max_blocks_per_seq=1, block_size=4,
                          scratch_block=5, graph_factory=EagerGraph)
    graphs.capture()
    batch = decode_batch([7, 8], [3, 4], [[0], [1]], 4)
    assert graphs(batch).flatten().tolist() == [4.0, 6.0]


class RefusingGraph(EagerGraph):
    """A capture that fails as torch's does on a host sync or a pageable copy inside it."""

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        raise RuntimeError("Cannot copy between CPU and CUDA tensors during CUDA graph capture")


def test_the_capture_rules_stand_in_refuses_host_reads_and_host_lists_not_scalars() -> None:
    x = torch.arange(4.0)
    assert torch.equal(CaptureRulesGraph().capture(lambda: x * torch.tensor(2.0) + 1), x * 2 + 1)
    for refused in (lambda: x * x.sum().item(), lambda: x[: int(x.argmax())], lambda: x + torch.tensor([1.0] * 4)):
        with pytest.raises(RuntimeError, match="during the capture"):
            CaptureRulesGraph().capture(refused)


def test_a_failed_capture_names_the_batch_size_and_the_way_around_it() -> None:
    graphs = DecodeGraphs(toy_forward([]), torch.device("cpu"), max_num_seqs=2, max_blocks_per_seq=1, block_size=4,
                          scratch_block=5, graph_factory=RefusingGraph)
    with pytest.raises(RuntimeError, match=r"decode step of 2 sequences in a CUDA graph failed: Cannot copy .*"
                                           r"--enforce-eager"):
        graphs.capture()


def test_steps_the_graphs_do_not_cover_run_eagerly() -> None:
    graphs = DecodeGraphs(toy_forward([]), torch.device("cpu"), max_num_seqs=4, max_blocks_per_seq=2,
                          block_size=4, scratch_block=9, graph_factory=EagerGraph)
    graphs.capture()
    too_many = decode_batch([1] * 5, [1] * 5, [[0]] * 5, 4)
    assert graphs(too_many) is None  # above the largest bucket
    too_wide = decode_batch([1], [9], [[0, 1, 2]], 4)
    assert graphs(too_wide) is None  # more blocks than max_model_len allows: never captured that width
    prefill = decode_batch([1, 2], [2, 2], [[0], [1]], 4)
    prefill.max_query_len = 2
    assert graphs(prefill) is None
    assert graphs.replays == 0


def test_the_cuda_backend_captures_nothing_on_cpu_tensors_and_keeps_a_scratch_block() -> None:
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    from pluginfer.backends import cuda
    from pluginfer.core.protocols import KVCacheSpec

    backend = cuda.CudaBackend(device=torch.device("cpu"))
    caches = backend.allocate_kv_cache(KVCacheSpec(num_layers=1, num_kv_heads=2, head_dim=8), 10, 4, torch.float32)
    assert caches[0][0].shape[0] == 11 and backend.scratch_block == 10
    assert backend.capture_decode(lambda batch: batch.input_ids, 4, 2, 4) is None


def test_enforce_eager_is_a_flag_and_an_llm_keyword() -> None:
    from pluginfer.cli.options import keywords, options
    from pluginfer.core.config import EngineConfig

    assert EngineConfig(model="m").enforce_eager is False
    assert any(option.flag == "--enforce-eager" and option.boolean for option in options())
    assert keywords()["enforce_eager"] == "enforce_eager"
