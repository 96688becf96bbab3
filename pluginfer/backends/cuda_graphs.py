"""CUDA graphs for decode steps at bucketed batch sizes (the cuda backend's ``capture_decode``).

A decode step of ``n`` sequences replays the graph of the smallest bucket ``>= n`` (1, 2, 4, then multiples of
8 up to ``max_num_seqs``, as vLLM's) on static buffers; padding rows read and write only a scratch KV block the
scheduler never hands out, and block tables keep their full width, so every replay has its capture's shapes.
Prefill, mixed and larger steps run eagerly, as does everything under ``--enforce-eager``. Tested on an H100
(``tests/backends/test_cuda_engine.py``) and, without a GPU, with a stand-in graph (``test_cuda_graphs.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from pluginfer.core.batch import ForwardBatch
from pluginfer.layers.attention_ops import PagedAttentionMetadata


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The batch sizes graphs are captured for: 1, 2, 4, then multiples of 8, up to ``max_num_seqs``."""
    sizes = [size for size in (1, 2, 4) if size <= max_num_seqs] + list(range(8, max_num_seqs + 1, 8))
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)  # the largest batch the scheduler makes gets a graph too
    return sizes


def bucket_for(sizes: list[int], num_seqs: int) -> int | None:
    """The smallest captured size holding ``num_seqs`` sequences, or None (the step runs eagerly)."""
    return next((size for size in sizes if size >= num_seqs), None)


class Graph(Protocol):
    """What a captured graph does here: capture ``fn`` once (its output tensor is static), replay later."""

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor: ...

    def replay(self) -> None: ...


class CudaGraph:
    """``torch.cuda.CUDAGraph`` over one memory pool shared by every bucket's graph."""

    def __init__(self, pool: object) -> None:
        self.graph, self.pool = torch.cuda.CUDAGraph(), pool

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        with torch.cuda.graph(self.graph, pool=self.pool):
            return fn()

    def replay(self) -> None:
        self.graph.replay()


def is_decode(batch: ForwardBatch) -> bool:
    return batch.num_seqs > 0 and batch.max_query_len == 1


class DecodeGraphs:
    """Static decode buffers, one captured graph per bucket, and the step that replays them.

    ``forward(batch) -> hidden [tokens, hidden]`` is the model's forward; ``scratch_block`` a KV block no
    sequence uses; ``graph_factory()`` makes one :class:`Graph` (CUDA graphs on a GPU).
    """

    def __init__(self, forward: Callable[[ForwardBatch], torch.Tensor], device: torch.device, max_num_seqs: int,
                 max_blocks_per_seq: int, block_size: int, scratch_block: int,
                 graph_factory: Callable[[], Graph]) -> None:
        self.forward, self.block_size, self.scratch_block = forward, block_size, scratch_block
        self.sizes = capture_sizes(max_num_seqs)
        self.graph_factory = graph_factory
        largest = self.sizes[-1]

        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, dtype=torch.int64, device=device)

        self.input_ids, self.positions, self.slot_mapping = zeros(largest), zeros(largest), zeros(largest)
        self.seq_lens, self.block_tables = zeros(largest), zeros(largest, max_blocks_per_seq)
        self.query_start_loc = torch.arange(largest + 1, dtype=torch.int64, device=device)
        self.empty_starts = zeros(1)
        self.graphs: dict[int, Graph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.replays = 0
        self._pad(0, largest)

    def _pad(self, start: int, stop: int) -> None:
        """Rows ``start:stop`` become padding: one key each, in the scratch block."""
        self.input_ids[start:stop] = 0
        self.positions[start:stop] = 0
        self.slot_mapping[start:stop] = self.scratch_block * self.block_size
        self.seq_lens[start:stop] = 1
        self.block_tables[start:stop] = self.scratch_block

    def static_batch(self, size: int) -> ForwardBatch:
        """The first ``size`` rows of the static buffers as a decode batch (what a graph is captured on)."""
        batch = ForwardBatch(
            input_ids=self.input_ids[:size], positions=self.positions[:size], slot_mapping=self.slot_mapping[:size],
            query_start_loc=self.query_start_loc[:size + 1], seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size], logits_indices=self.query_start_loc[:size],
            query_lens=[1] * size, max_query_len=1, max_seq_len=self.block_tables.shape[1] * self.block_size,
            block_size=self.block_size)
        batch.attention = PagedAttentionMetadata(size, batch.block_tables, batch.seq_lens, self.empty_starts, 0)
        return batch

    def load(self, batch: ForwardBatch) -> int | None:
        """Copy a decode batch into the static buffers, pad it to its bucket and return the bucket (None: the
        step is not a decode step, or is larger than every bucket, and runs eagerly)."""
        if not is_decode(batch):
            return None
        num_seqs = batch.num_seqs
        size = bucket_for(self.sizes, num_seqs)
        width = batch.block_tables.shape[1]
        if size is None or width > self.block_tables.shape[1]:
            return None
        self.input_ids[:num_seqs].copy_(batch.input_ids)
        self.positions[:num_seqs].copy_(batch.positions)
        self.slot_mapping[:num_seqs].copy_(batch.slot_mapping)
        self.seq_lens[:num_seqs].copy_(batch.seq_lens)
        self.block_tables[:num_seqs, :width].copy_(batch.block_tables)
        self.block_tables[:num_seqs, width:] = 0  # columns past a sequence's blocks are never read
        self._pad(num_seqs, size)
        return size

    def capture(self) -> None:
        """One warm-up run and one capture per bucket, largest first (the pool's biggest allocations first).

        Each run gets a fresh batch over the same static buffers: layers cache per-step tensors in
        ``batch.extras`` (rotary's cos/sin of the positions), which must be computed inside the capture from
        the static positions, not carried over from the warm-up (a replay would reuse the warm-up's values).
        """
        for size in reversed(self.sizes):
            # warm-up: Triton compiles, allocators settle outside the capture
            self.forward(self.static_batch(size))
            graph = self.graph_factory()
            try:
                self.outputs[size] = graph.capture(lambda size=size: self.forward(self.static_batch(size)))
            except RuntimeError as exc:
                # a host sync or a pageable copy in the model's decode forward
                raise RuntimeError(f"capturing the decode step of {size} sequences in a CUDA graph failed: {exc} "
                                   "(--enforce-eager runs decode steps without graphs)") from exc
            self.graphs[size] = graph

    def __call__(self, batch: ForwardBatch) -> torch.Tensor | None:
        """The step's output (the worker's forward gives logits) from a graph replay, or None (run it eagerly).
        The worker calls it outside ``torch.inference_mode``; the copies into the static buffers need it."""
        with torch.inference_mode():
            size = self.load(batch)
            if size is None or size not in self.graphs:
                return None
            self.graphs[size].replay()
            self.replays += 1
            return self.outputs[size][:batch.num_seqs]
