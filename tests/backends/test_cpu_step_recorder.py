"""The recording of a decode step (``backends/cpu_step_replay.py``, ``csrc/step_replay.c``) on a stand-in
forward: each torch op it translates into a copy-like entry replays what torch computes (adds, products by a
scalar and 16-bit conversions rounded as torch rounds them), steps it does not record stay eager, and the
ops table names the C entries in their order. Whole models replayed against ``enforce_eager`` are in
tests/backends/test_cpu_step_replay.py.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pluginfer.backends.cpu import layer_ops as native_layer_ops
from pluginfer.backends.cpu import ops as native
from pluginfer.backends.cpu import quant as native_quant
from pluginfer.backends.cpu import replay as native_replay
from pluginfer.backends.cpu.backend import CpuBackend
from pluginfer.backends.cpu.step_replay import CpuDecodeReplay
from pluginfer.core.batch import ForwardBatch

pytestmark = pytest.mark.skipif(native.available() is not None, reason="the native kernels did not load")


# -- The recording itself, on a stand-in forward -------------------------------------------------------------


def decode_batch(ids: list[int], positions: list[int], slots: list[int], width: int = 2) -> ForwardBatch:
    n = len(ids)

    def longs(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64)

    return ForwardBatch(input_ids=longs(ids), positions=longs(positions), slot_mapping=longs(slots),
                        query_start_loc=torch.arange(n + 1), seq_lens=longs([p + 1 for p in positions]),
                        block_tables=torch.zeros(n, width, dtype=torch.int64), logits_indices=torch.arange(n),
                        query_lens=[1] * n, max_query_len=1, max_seq_len=max(positions) + 1, block_size=4)


class StandIn:
    """Every torch op a recording translates, and a native kernel, between a batch's ids and its output."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.table = torch.randn(50, 16, generator=generator)
        self.half_table = torch.randn(50, 16, generator=generator).to(torch.bfloat16)
        self.cos = torch.randn(40, 8, generator=generator)
        self.weight = torch.randn(32, generator=generator)
        self.bias = torch.randn(32, generator=generator)
        self.cache = torch.zeros(64, 32)

    def __call__(self, batch: ForwardBatch) -> torch.Tensor:
        ids = batch.input_ids
        hidden = F.embedding(ids, self.table)  # embedding
        half = self.half_table.index_select(0, ids).to(torch.float32)  # index_select, bfloat16 -> float32
        cos = self.cos[batch.positions]  # index.Tensor
        both = torch.cat([hidden, half], dim=-1)  # cat along the last axis
        self.cache.index_copy_(0, batch.slot_mapping, both)  # the KV write
        strided = torch.cat([both, both], dim=0)[:, 8:24].contiguous()  # cat along rows; strided rows copied
        normed = native_layer_ops.rms_norm(both + both, None, self.weight, 1e-5, 0.0)  # add; a native kernel
        summed = normed.add_(self.bias)  # one row added to every row, in place
        return torch.cat([summed, strided.reshape(-1, 16)[: ids.shape[0]], cos], dim=-1)


def test_translated_ops_replay_what_torch_computes() -> None:
    model, reference = StandIn(), StandIn()
    replay = CpuDecodeReplay(model, max_num_seqs=4, max_blocks_per_seq=8, block_size=4)
    steps = [([1, 2, 3], [4, 9, 30], [0, 5, 9]), ([7, 2, 49], [5, 10, 31], [1, 6, 10]),
             ([0, 0, 8], [6, 11, 32], [2, 7, 11])]
    for number, (ids, positions, slots) in enumerate(steps):
        out = replay(decode_batch(ids, positions, slots)).clone()
        assert torch.equal(out, reference(decode_batch(ids, positions, slots)))
        assert torch.equal(model.cache, reference.cache)
        assert replay.replays == number  # the first step of 3 rows was recorded, the others replayed
    names = replay.programs[3][0].names
    assert names.count("gather_rows") == 3 and names.count("copy_rows") == 8 and "scatter_rows" in names
    assert names.count("add_f32") == 2 and "to_f32" in names and "rms_norm" in names


def test_a_sizes_first_eager_steps_are_not_recorded() -> None:
    """``eager_steps=1`` (the cpu backend's): each batch size's first step returns None (the worker runs it
    eagerly), its second is recorded and the third replayed, each equal to the eager step."""
    model, reference = StandIn(), StandIn()
    replay = CpuDecodeReplay(model, max_num_seqs=4, max_blocks_per_seq=8, block_size=4, eager_steps=1)
    steps = [([1, 2, 3], [4, 9, 30], [0, 5, 9]), ([7, 2, 49], [5, 10, 31], [1, 6, 10]),
             ([0, 0, 8], [6, 11, 32], [2, 7, 11])]
    assert replay(decode_batch(*steps[0])) is None and replay.programs == {}
    model(decode_batch(*steps[0]))  # as the worker does: the step eagerly
    reference(decode_batch(*steps[0]))
    for number, step in enumerate(steps[1:]):
        out = replay(decode_batch(*step)).clone()
        assert torch.equal(out, reference(decode_batch(*step))) and torch.equal(model.cache, reference.cache)
        assert replay.replays == number and replay.programs[3] is not None
    assert replay(decode_batch([5], [7], [3])) is None and 1 not in replay.programs  # another size: eager first


@pytest.mark.parametrize(("dtype", "entry", "exponents"), [(torch.bfloat16, "add_bf16", (-20, 20)),
                                                           (torch.float16, "add_f16", (-26, 16))])
def test_16_bit_adds_round_as_torch_does(dtype: torch.dtype, entry: str, exponents: tuple[int, int]) -> None:
    """Sums that need rounding (magnitudes far apart; in float16 subnormal sums, and infinities from the
    table and from sums that overflow), a row added to every row, and NaN."""
    generator = torch.Generator().manual_seed(1)
    scales = 2.0 ** torch.randint(*exponents, (64, 256), generator=generator)
    table = (torch.randn(64, 256, generator=generator) * scales).to(dtype)
    table[3, 7] = float("nan")
    table[[3, 9], :4] = 40000.0  # rows 9 + 3 are added below: in float16 their sum overflows to infinity
    row = torch.randn(256, generator=generator).to(dtype)

    def forward(batch: ForwardBatch) -> torch.Tensor:
        a, b = table.index_select(0, batch.input_ids), table.index_select(0, batch.positions)
        return torch.cat([a + b, a + row], dim=-1)

    replay = CpuDecodeReplay(forward, max_num_seqs=4, max_blocks_per_seq=2, block_size=4)
    replay(decode_batch([1, 2, 3, 4], [5, 6, 7, 8], [0, 1, 2, 3]))
    for ids, positions in (([3, 9, 60, 11], [20, 3, 61, 5]), ([0, 1, 2, 3], [63, 62, 61, 60])):
        out, expected = replay(decode_batch(ids, positions, [0, 1, 2, 3])), forward(decode_batch(ids, positions, [0, 1, 2, 3]))
        assert torch.equal(out.isnan(), expected.isnan())  # (a NaN's bits: torch's scalar tail writes others)
        assert torch.equal(out.masked_fill(out.isnan(), 0).view(torch.int16),
                           expected.masked_fill(expected.isnan(), 0).view(torch.int16))
    assert replay.replays == 2 and entry in replay.programs[4][0].names


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_products_by_a_scalar_round_as_torch_does(dtype: torch.dtype) -> None:
    """``rows * torch.tensor(scale, dtype=...)`` (Gemma's embedding scale, the tensor made in the step):
    products that round, overflow to infinity in float16, NaN."""
    generator = torch.Generator().manual_seed(2)
    table = (torch.randn(64, 256, generator=generator) * 2.0 ** torch.randint(-20, 12, (64, 256), generator=generator))
    table = table.to(dtype)
    table[3, 7] = float("nan")

    def forward(batch: ForwardBatch) -> torch.Tensor:
        return table.index_select(0, batch.input_ids) * torch.tensor(2048**0.5, dtype=dtype)

    replay = CpuDecodeReplay(forward, max_num_seqs=4, max_blocks_per_seq=2, block_size=4)
    replay(decode_batch([1, 2, 3, 4], [5, 6, 7, 8], [0, 1, 2, 3]))
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    for ids in ([3, 9, 60, 11], [0, 1, 2, 63]):
        out, expected = replay(decode_batch(ids, [5, 6, 7, 8], [0, 1, 2, 3])), forward(decode_batch(ids, [5, 6, 7, 8], [0, 1, 2, 3]))
        assert torch.equal(out.isnan(), expected.isnan())
        assert torch.equal(out.masked_fill(out.isnan(), 0).view(bits), expected.masked_fill(expected.isnan(), 0).view(bits))
    assert replay.replays == 2 and replay.programs[4][0].names == ["gather_rows", "mul_scalar"]
    if dtype == torch.float16:
        assert bool(expected.isinf().any())  # (products past 65504)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_float32_to_16_bit_rounds_as_torch_does(dtype: torch.dtype) -> None:
    """``.to(dtype)`` of float32 rows: ties and near-ties, subnormal results, overflow to infinity, NaN."""
    generator = torch.Generator().manual_seed(4)
    table = torch.randn(64, 256, generator=generator) * 2.0 ** torch.randint(-30, 20, (64, 256), generator=generator)
    table[3, 7] = float("nan")
    table[5, :8] = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-11, 1 + 3 * 2**-11, 65520.0, -65519.0, 2**-25, 3e38])

    def forward(batch: ForwardBatch) -> torch.Tensor:
        return table.index_select(0, batch.input_ids).to(dtype)

    replay = CpuDecodeReplay(forward, max_num_seqs=4, max_blocks_per_seq=2, block_size=4)
    replay(decode_batch([1, 2, 3, 4], [5, 6, 7, 8], [0, 1, 2, 3]))
    for ids in ([3, 9, 60, 5], [0, 1, 2, 63]):
        out, expected = replay(decode_batch(ids, [5, 6, 7, 8], [0, 1, 2, 3])), forward(decode_batch(ids, [5, 6, 7, 8], [0, 1, 2, 3]))
        assert torch.equal(out.isnan(), expected.isnan())
        assert torch.equal(out.masked_fill(out.isnan(), 0).view(torch.int16),
                           expected.masked_fill(expected.isnan(), 0).view(torch.int16))
    assert replay.replays == 2 and replay.programs[4][0].names == ["gather_rows", "from_f32"]


def test_other_steps_stay_eager() -> None:
    replay = CpuDecodeReplay(StandIn(), max_num_seqs=2, max_blocks_per_seq=2, block_size=4)
    prefill = decode_batch([1, 2], [0, 1], [0, 1])
    prefill.query_lens, prefill.max_query_len, prefill.query_start_loc = [2], 2, torch.tensor([0, 2])
    prefill.seq_lens = torch.tensor([2])
    assert replay(prefill) is None  # not a decode step
    assert replay(decode_batch([1, 2, 3], [0, 1, 2], [0, 1, 2])) is None  # more rows than max_num_seqs
    assert replay(decode_batch([1], [0], [0], width=3)) is None  # block tables wider than the buffers
    assert replay.programs == {}


def test_an_untranslated_torch_op_keeps_that_size_eager(caplog: pytest.LogCaptureFixture) -> None:
    def forward(batch: ForwardBatch) -> torch.Tensor:
        return torch.sin(batch.positions.float())

    replay = CpuDecodeReplay(forward, max_num_seqs=4, max_blocks_per_seq=2, block_size=4)
    with caplog.at_level(logging.DEBUG, logger="pluginfer.backends.cpu.step_replay"):
        first = replay(decode_batch([1, 2], [3, 4], [0, 1]))  # the recording run is the eager step itself
    assert torch.equal(first, torch.sin(torch.tensor([3.0, 4.0])))
    assert replay.programs == {2: None}
    assert "batches of 2 stay eager (torch op aten." in caplog.text
    assert replay(decode_batch([5, 6], [5, 6], [2, 3])) is None  # from now on, eager


def test_recordings_past_the_memory_budget_stay_eager(caplog: pytest.LogCaptureFixture) -> None:
    replay = CpuDecodeReplay(StandIn(), max_num_seqs=4, max_blocks_per_seq=8, block_size=4, memory_budget=5000)
    replay(decode_batch([1, 2], [4, 9], [0, 5]))  # a step of 2 rows allocates ~1.9 KiB, one of 4 ~3.9 KiB
    assert replay.programs[2] is not None and 0 < replay.held_bytes < 5000
    with caplog.at_level(logging.DEBUG, logger="pluginfer.backends.cpu.step_replay"):
        replay(decode_batch([1, 2, 3, 4], [4, 9, 30, 31], [0, 5, 9, 12]))
        replay(decode_batch([1, 2, 3, 4], [5, 10, 31, 32], [1, 6, 10, 13]))
    assert replay.programs[4] is None and "past the 0 MiB the recordings may hold" in caplog.text
    assert replay(decode_batch([3, 4], [5, 10], [1, 6])) is not None and replay.replays == 1


def test_replay_ops_name_the_c_entries_in_their_order() -> None:
    """native_replay.REPLAY_OPS gives each op the code of its OP_ entry in csrc/step_replay.c's enum."""
    source = (Path(native_replay.__file__).parent / "csrc" / "step_replay.c").read_text()
    enum = source[source.index("enum {"):source.index("};", source.index("enum {"))]
    names = [name.lower() for name in re.findall(r"OP_(\w+)", enum)]
    assert tuple(names) == native_replay.REPLAY_OPS


def test_a_native_call_without_replay_entry_refuses() -> None:
    def forward(batch: ForwardBatch) -> torch.Tensor:
        levels, _ = native_quant.quantize_activations(torch.ones(batch.num_seqs, 32))
        return levels.float()

    replay = CpuDecodeReplay(forward, max_num_seqs=4, max_blocks_per_seq=2, block_size=4)
    replay(decode_batch([1], [3], [0]))
    assert replay.programs == {1: None}


def test_a_replayed_index_out_of_range_is_an_error_naming_the_entry() -> None:
    model = StandIn()
    replay = CpuDecodeReplay(model, max_num_seqs=4, max_blocks_per_seq=8, block_size=4)
    replay(decode_batch([1, 2], [4, 9], [0, 5]))
    with pytest.raises(RuntimeError, match=r"step replay: entry 0 \(gather_rows\) failed with status -1"):
        replay(decode_batch([1, 50], [5, 10], [1, 6]))  # id 50 of a 50-row table


def test_nothing_to_replay_without_native_kernels_or_under_tensor_parallelism() -> None:
    from pluginfer.core.protocols import RankInfo

    assert CpuBackend(native_kernels=False).capture_decode(lambda batch: None, 4, 2, 4) is None
    assert CpuBackend(rank=RankInfo(rank=0, world_size=2, tp_size=2)).capture_decode(lambda b: None, 4, 2, 4) is None
    assert isinstance(CpuBackend().capture_decode(lambda batch: None, 4, 2, 4), CpuDecodeReplay)
