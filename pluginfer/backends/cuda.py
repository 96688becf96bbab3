"""The cuda backend: paged KV cache in GPU memory, Triton kernels for attention and the fused layer ops.

Each kernel is an op of ``core.kernels`` registered into its ``KernelTable`` (``triton_kernels/``, one module per
op). Quantized linears run only through their kernels (a format without one is a build-time error:
``quant_kernels_required``); dense linears, routing and sampling run in torch on the GPU. Decode steps replay
CUDA graphs (``cuda_graphs.py``). Device ``cuda:{local_rank}``; with ``PLUGINFER_CUDA_ON_CPU=1`` and
``TRITON_INTERPRET=1`` it keeps tensors on the CPU and runs every kernel in Triton's interpreter, for tests.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable

import torch

from pluginfer.core.batch import ForwardBatch
from pluginfer.core.protocols import KVCacheSpec, RankInfo
from pluginfer.layers.backend_base import BaseDeviceBackend
from pluginfer.layers.kv_quant import FLOAT_KV_DTYPES, QUANTIZED_KV_DTYPES

ON_CPU = "PLUGINFER_CUDA_ON_CPU"


def _on_cpu_requested() -> bool:
    return os.environ.get(ON_CPU) == "1"


def why_not_usable() -> str | None:
    """The spec's check: None when the backend can run here, else why not."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (pip install triton)"
    if _on_cpu_requested():
        if os.environ.get("TRITON_INTERPRET") != "1":
            return f"{ON_CPU}=1 needs TRITON_INTERPRET=1 (Triton's interpreter runs the kernels on CPU tensors)"
        return None
    if not torch.cuda.is_available():
        return "no CUDA device"
    return None


class CudaBackend(BaseDeviceBackend):
    """One GPU (``cuda:{local_rank}``); ``device`` overrides it (a CPU device only under Triton's interpreter).

    Memory, paged attention through the table, block copies and ``op`` are ``BaseDeviceBackend``'s; this class
    adds the Triton kernels, the scratch KV block and the CUDA graphs."""

    name = "cuda"
    # Quantized weights run only through this backend's kernels: a format without one is a build-time error
    # (layers.context.quant_kernel), never the torch dequantize path's silent slowness.
    quant_kernels_required = True
    # Quantized KV caches: write_kv, decode and prefill attention read layers/kv_quant.py's rows (kv_codes.py).
    kv_cache_dtypes = (*FLOAT_KV_DTYPES, *QUANTIZED_KV_DTYPES.values())

    def __init__(self, config: object = None, rank: RankInfo | None = None,
                 device: torch.device | None = None) -> None:
        rank = rank or RankInfo()
        if device is None:
            device = torch.device("cpu") if _on_cpu_requested() else torch.device("cuda", rank.local_rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)  # NCCL and every later allocation use this rank's GPU
        super().__init__(device)
        # On CPU tensors (the interpreter), ranks talk over gloo: NCCL needs GPUs.
        self.default_collective = "nccl" if device.type == "cuda" else "gloo"
        from pluginfer.backends import triton_kernels  # imports triton: only once the backend is chosen

        triton_kernels.register(self.kernels)

    def free_memory(self) -> int:
        """What ``torch.cuda.mem_get_info`` reports free; on CPU tensors (the interpreter), the host's free pages."""
        if self.device.type != "cuda":
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return super().free_memory()

    def allocate_kv_cache(self, spec: KVCacheSpec, num_blocks: int, block_size: int,
                          dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One block more than asked for: block ``num_blocks`` is the scratch block that the padding rows of a
        CUDA-graph decode step read and write (the scheduler never hands it out)."""
        self.scratch_block = num_blocks
        return super().allocate_kv_cache(spec, num_blocks + 1, block_size, dtype)

    def capture_decode(self, forward: Callable[[ForwardBatch], torch.Tensor], max_num_seqs: int,
                       max_blocks_per_seq: int, block_size: int) -> Callable[[ForwardBatch], torch.Tensor | None] | None:
        """CUDA graphs of ``forward`` for decode steps at bucketed batch sizes (``backends/cuda_graphs.py``;
        run on an H100). None on CPU tensors (Triton's interpreter): there is nothing to capture."""
        if self.device.type != "cuda":
            return None
        from pluginfer.backends.cuda_graphs import CudaGraph, DecodeGraphs

        pool = torch.cuda.graph_pool_handle()
        graphs = DecodeGraphs(forward, self.device, max_num_seqs, max_blocks_per_seq, block_size, self.scratch_block,
                              lambda: CudaGraph(pool))
        graphs.capture()
        return graphs


def build(config: object = None, rank: RankInfo | None = None) -> CudaBackend:
    return CudaBackend(config, rank)
