"""Decode steps replayed in one native call: the cpu backend's ``capture_decode``.

A tiny model's decode step is mostly Python between the kernels. The second step of ``n`` sequences runs
eagerly on static buffers while ``replay.recording()`` notes every native call and a ``TorchDispatchMode``
turns the few copy-like torch ops into ``csrc/step_replay.c`` entries (any other op refuses: that size stays
eager). Later steps of ``n`` copy their inputs into the buffers and run the program in one C call: the same
kernels and arguments, so the same bits. The LM head is recorded after the layers where it can be. The
recordings keep their tensors alive, at most ``MEMORY_BUDGET`` bytes in all.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from pluginfer.backends.cpu import replay
from pluginfer.core.batch import ForwardBatch

logger = logging.getLogger(__name__)
aten = torch.ops.aten

# Ops that only allocate (what they leave in memory is written by a later entry before it is read).
_ALLOCATIONS = {aten.empty.memory_format, aten.empty_like.default, aten.new_empty.default,
                aten.empty_strided.default, aten.new_empty_strided.default}
# Ops that change a tensor's autograd metadata, not its memory (``torch.tensor(value)`` detaches its result).
_METADATA_ONLY = {aten.detach_.default}
_SIXTEEN_BIT = {torch.bfloat16: 0, torch.float16: 1}


def _inner_contiguous(tensor: torch.Tensor) -> bool:
    """Each index along the first axis is one contiguous run of memory."""
    expected = 1
    for size, stride in zip(reversed(tensor.shape[1:]), reversed(tensor.stride()[1:])):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _row_bytes(tensor: torch.Tensor) -> int:
    return (tensor.numel() // tensor.shape[0] if tensor.shape[0] else 0) * tensor.element_size()


def _index(index: object) -> bool:
    return isinstance(index, torch.Tensor) and index.dtype == torch.int64 and index.dim() == 1 \
        and index.is_contiguous()


def _gather(recorder: replay.StepRecording, source: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> bool:
    """``out = source[index]`` along the first axis."""
    if not (_index(index) and source.dim() >= 1 and _inner_contiguous(source) and out.is_contiguous()
            and out.dtype == source.dtype and out.shape[0] == index.shape[0]):
        return False
    recorder.append("gather_rows", source.data_ptr(), source.shape[0], source.stride(0) * source.element_size(),
                    index.data_ptr(), index.shape[0], _row_bytes(source), out.data_ptr())
    return True


def _embedding(recorder: replay.StepRecording, out: torch.Tensor, weight: torch.Tensor, indices: torch.Tensor,
               *rest: object) -> bool:
    return weight.dim() == 2 and _gather(recorder, weight, indices, out)


def _index_select(recorder: replay.StepRecording, out: torch.Tensor, source: torch.Tensor, dim: int,
                  index: torch.Tensor) -> bool:
    return dim == 0 and _gather(recorder, source, index, out)


def _index_tensor(recorder: replay.StepRecording, out: torch.Tensor, source: torch.Tensor,
                  indices: list) -> bool:
    return len(indices) == 1 and _gather(recorder, source, indices[0], out)


def _index_copy(recorder: replay.StepRecording, out: torch.Tensor, target: torch.Tensor, dim: int,
                index: torch.Tensor, source: torch.Tensor) -> bool:
    """``target[index] = source`` along the first axis (the KV cache write)."""
    if not (dim == 0 and _index(index) and target.is_contiguous() and source.dtype == target.dtype
            and source.dim() == target.dim() and source.shape[1:] == target.shape[1:]
            and _inner_contiguous(source) and source.shape[0] == index.shape[0] and out is target):
        return False
    recorder.append("scatter_rows", target.data_ptr(), target.shape[0], index.data_ptr(), source.data_ptr(),
                    source.stride(0) * source.element_size(), index.shape[0], _row_bytes(target))
    return True


# The adds step_replay.c makes as torch makes them: float32, and bfloat16 and float16 (summed in float32,
# rounded to nearest even).
_ADDS = {torch.float32: "add_f32", torch.bfloat16: "add_bf16", torch.float16: "add_f16"}


def _add(recorder: replay.StepRecording, out: torch.Tensor, a: torch.Tensor, b: object, alpha: object = 1) -> bool:
    """``a + b`` in float32, bfloat16 or float16: ``b`` of ``a``'s shape, or one row added to every row of
    ``a``."""
    if not (isinstance(b, torch.Tensor) and alpha == 1 and a.dtype == b.dtype == out.dtype and a.dtype in _ADDS
            and a.is_contiguous() and b.is_contiguous() and out.is_contiguous() and a.shape == out.shape
            and a.dim() >= 1):
        return False
    cols = a.shape[-1]
    rows = a.numel() // cols if cols else 0
    if b.shape == a.shape:
        b_stride = cols
    elif b.dim() == 1 and b.shape[0] == cols:
        b_stride = 0
    else:
        return False
    recorder.append(_ADDS[a.dtype], a.data_ptr(), b.data_ptr(), out.data_ptr(), rows, cols, b_stride)
    return True


# The dtypes mul_scalar takes, by its code in step_replay.c.
_MUL_SCALAR = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def _mul(recorder: replay.StepRecording, out: torch.Tensor, a: torch.Tensor, b: object) -> bool:
    """``a * s`` for a 0-dim tensor ``s`` of ``a``'s dtype (Gemma's embedding scale), as torch rounds it."""
    if not (isinstance(b, torch.Tensor) and b.dim() == 0 and a.dtype == b.dtype == out.dtype
            and a.dtype in _MUL_SCALAR and a.is_contiguous() and out.is_contiguous() and a.shape == out.shape):
        return False
    recorder.append("mul_scalar", a.data_ptr(), b.data_ptr(), out.data_ptr(), a.numel(), _MUL_SCALAR[a.dtype])
    return True


def _to_copy(recorder: replay.StepRecording, out: torch.Tensor, source: torch.Tensor, **kwargs: object) -> bool:
    """A bfloat16/float16 tensor as float32 (exact), or a float32 one as bfloat16/float16 (rounded to nearest
    even, as torch rounds: a GGUF file's F16 embedding rows, widened, in a 16-bit model)."""
    if not (source.is_contiguous() and out.is_contiguous() and out.numel() == source.numel()):
        return False
    if source.dtype in _SIXTEEN_BIT and out.dtype == torch.float32:
        recorder.append("to_f32", source.data_ptr(), _SIXTEEN_BIT[source.dtype], out.data_ptr(), source.numel())
        return True
    if source.dtype == torch.float32 and out.dtype in _SIXTEEN_BIT:
        recorder.append("from_f32", source.data_ptr(), _SIXTEEN_BIT[out.dtype], out.data_ptr(), source.numel())
        return True
    return False


def _to_dtype(recorder: replay.StepRecording, out: torch.Tensor, source: torch.Tensor, dtype: torch.dtype,
              *rest: object, **kwargs: object) -> bool:
    """``tensor.to(dtype)`` / ``.float()`` as it reaches the dispatcher for a tensor made outside inference
    mode (a GGUF file's F16 embedding rows): where it copies, the same conversion as ``_to_copy``."""
    return _to_copy(recorder, out, source)


def _copy(recorder: replay.StepRecording, out: torch.Tensor, source: torch.Tensor, *rest: object,
          **kwargs: object) -> bool:
    """``contiguous()`` / ``reshape`` / ``clone`` of a tensor whose rows may be strided: its rows back to back."""
    if not (isinstance(out, torch.Tensor) and out.is_contiguous() and out.dtype == source.dtype
            and out.numel() == source.numel() and source.dim() >= 1 and _inner_contiguous(source)):
        return False
    recorder.append("copy_rows", source.data_ptr(), source.stride(0) * source.element_size(), source.shape[0],
                    _row_bytes(source), out.data_ptr(), _row_bytes(source))
    return True


def _cat(recorder: replay.StepRecording, out: torch.Tensor, parts: list, dim: int = 0) -> bool:
    """``torch.cat`` of 2-d tensors with contiguous rows, along either axis (a GGUF projection whose
    parts have two quant types is two matmuls concatenated)."""
    if not (out.dim() == 2 and out.is_contiguous() and dim in (0, 1, -1, -2)
            and all(part.dim() == 2 and part.dtype == out.dtype and _inner_contiguous(part) for part in parts)):
        return False
    along_rows, at = dim in (0, -2), out.data_ptr()
    out_stride = out.stride(0) * out.element_size()
    for part in parts:
        row_bytes = part.shape[1] * part.element_size()
        recorder.append("copy_rows", part.data_ptr(), part.stride(0) * part.element_size(), part.shape[0], row_bytes,
                        at, out_stride)
        at += part.shape[0] * out_stride if along_rows else row_bytes
    return True


def _aliases(out: object, source: object) -> bool:
    """Every tensor ``out`` holds shares ``source``'s memory (the op was a view, not a copy)."""
    if not isinstance(source, torch.Tensor):
        return False
    storage = source.untyped_storage().data_ptr()
    outputs = out if isinstance(out, (list, tuple)) else [out]
    return all(isinstance(tensor, torch.Tensor) and tensor.untyped_storage().data_ptr() == storage
               for tensor in outputs)


# Ops whose schema says they may alias their input but that copy when they must: a copy is noted.
_MAYBE_COPIES = {aten.contiguous.default: _copy, aten.reshape.default: _copy, aten.to.dtype: _to_dtype}

# torch ops a recording turns into step_replay entries: (recorder, the op's output, its arguments) -> noted.
_TRANSLATED: dict[object, Callable[..., bool]] = {
    aten.embedding.default: _embedding,
    aten.index_select.default: _index_select,
    aten.index.Tensor: _index_tensor,
    aten.index_copy_.default: _index_copy,
    aten.add.Tensor: _add,
    aten.add_.Tensor: _add,
    aten.mul.Tensor: _mul,
    aten._to_copy.default: _to_copy,
    aten.cat.default: _cat,
    aten.clone.default: _copy,
}


def _has_storage(value: object) -> bool:
    """A tensor with memory of its own: oneDNN's packed weights (where no panel GEMM is built) have none."""
    return isinstance(value, torch.Tensor) and not value.is_mkldnn


class _WatchTorchOps(TorchDispatchMode):
    """Runs every torch op and, for the recording, passes views and allocations, notes the copy-like
    ops as replay entries and refuses the rest; keeps every tensor the ops touched alive."""

    def __init__(self, recorder: replay.StepRecording, keep: list[torch.Tensor]) -> None:
        super().__init__()
        self.recorder, self.keep = recorder, keep
        # memory the step's ops allocated, which the recording holds from now on
        self.new_bytes = 0
        self._storages: set[int] = set()

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """Nothing here is compiled: without this, the first op imports torch._dynamo, a slow import."""
        return False

    def __torch_dispatch__(self, func: object, types: object, args: tuple = (), kwargs: dict | None = None) -> object:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        tensors = [value for value in tree_flatten((args, kwargs, out))[0] if isinstance(value, torch.Tensor)]
        self.keep.extend(tensors)
        if not func.is_view:
            # new memory: outputs in storages no input had (not an in-place op's target)
            inputs = {tensor.untyped_storage().data_ptr() for tensor in tree_flatten((args, kwargs))[0]
                      if _has_storage(tensor)}
            for tensor in tree_flatten(out)[0]:
                storage = tensor.untyped_storage() if _has_storage(tensor) else None
                if storage is not None and storage.data_ptr() not in inputs | self._storages:
                    self._storages.add(storage.data_ptr())
                    self.new_bytes += storage.nbytes()
        if self.recorder.refused is not None or func in _ALLOCATIONS or func in _METADATA_ONLY:
            return out
        if func.is_view or func is aten._unsafe_view.default:
            if _aliases(out, args[0] if args else None):
                return out
            translate = _MAYBE_COPIES.get(func)
        else:
            translate = _TRANSLATED.get(func)
        if any(tensor.device.type != "cpu" for tensor in tensors) or translate is None \
                or not translate(self.recorder, out, *args, **kwargs):
            self.recorder.refuse(f"torch op {func}")
        return out


# What the recordings of one worker may hold (their intermediates: each recorded batch size keeps its own,
# about rows x the layers' activations); a recording past it is dropped and its batch size stays eager.
MEMORY_BUDGET = 256 * 2**20


class CpuDecodeReplay:
    """``capture_decode``'s callable on the cpu backend: records a decode step of each batch size (the first
    past ``eager_steps`` of that size), replays the later ones (see the module's docstring). Returns the
    step's hidden states, or None where the step runs eagerly (not a decode step, larger than the buffers,
    one of a size's first ``eager_steps``, or a size whose recording was refused or would take the
    recordings past ``memory_budget`` bytes).

    ``eager_steps``: recording a step costs about twice an eager one (0.047 against 0.021 s of CPU for the
    135M Q4_1 file's first step), so the cpu backend (``capture_decode``) runs a size's first step eagerly
    and records its second: a process's first token does not wait for a recording."""

    def __init__(self, forward: Callable[[ForwardBatch], torch.Tensor], max_num_seqs: int,
                 max_blocks_per_seq: int, block_size: int, memory_budget: int = MEMORY_BUDGET,
                 eager_steps: int = 0, head: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self.forward, self.block_size, self.memory_budget = forward, block_size, memory_budget
        # ``head``: the LM head, recorded after ``forward`` (a replay then gives logits); where its recording is
        # refused (Gemma 2's soft-capping tanh), the forward alone is replayed and the head runs eagerly after it.
        self.head = head
        self.eager_head: set[int] = set()  # batch sizes whose program holds the forward only
        self.held_bytes = 0
        self.eager_steps = eager_steps
        self._eager_seen: dict[int, int] = {}  # batch size -> decode steps of it run eagerly so far

        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, dtype=torch.int64)

        self.input_ids, self.positions, self.slot_mapping = zeros(max_num_seqs), zeros(max_num_seqs), zeros(max_num_seqs)
        self.seq_lens, self.block_tables = zeros(max_num_seqs), zeros(max_num_seqs, max_blocks_per_seq)
        self.query_start_loc = torch.arange(max_num_seqs + 1, dtype=torch.int64)
        # numpy views of the buffers: a step's inputs go in by numpy assignment, cheaper than torch's copy_
        self._host = [buffer.numpy() for buffer in (self.input_ids, self.positions, self.slot_mapping, self.seq_lens)]
        self._host_tables = self.block_tables.numpy()
        self._views: tuple[tuple, list] = ((None,) * 5, [])  # the last batch's input tensors and their numpy views
        self._max_rows, self._max_width = max_num_seqs, max_blocks_per_seq
        self.programs: dict[int, tuple[replay.StepProgram, torch.Tensor, list[torch.Tensor]] | None] = {}
        self.replays = 0

    def static_batch(self, size: int) -> ForwardBatch:
        """The first ``size`` rows of the static buffers as a decode batch, with the cpu backend's metadata."""
        from pluginfer.backends.cpu.backend import CpuAttentionMetadata

        tables, seq_lens = self.block_tables[:size], self.seq_lens[:size]
        batch = ForwardBatch(
            input_ids=self.input_ids[:size], positions=self.positions[:size], slot_mapping=self.slot_mapping[:size],
            query_start_loc=self.query_start_loc[:size + 1], seq_lens=seq_lens, block_tables=tables,
            logits_indices=self.query_start_loc[:size], query_lens=[1] * size, max_query_len=1,
            max_seq_len=self.block_tables.shape[1] * self.block_size, block_size=self.block_size)
        batch.attention = CpuAttentionMetadata(None, None, num_native_decodes=size, decode_block_tables=tables,
                                               decode_seq_lens=seq_lens)
        return batch

    def _load(self, batch: ForwardBatch) -> bool:
        """Copy a decode batch into the static buffers; False: not a decode step these buffers hold."""
        ids, positions, slots, seq_lens, tables = (batch.input_ids, batch.positions, batch.slot_mapping,
                                                   batch.seq_lens, batch.block_tables)
        seen, views = self._views
        # The worker hands the same tensors again in a steady decode (their arrays written over): their numpy
        # views too (no torch call here: the first one after the last step's kernels is slow).
        if not (ids is seen[0] and positions is seen[1] and slots is seen[2] and seq_lens is seen[3]
                and tables is seen[4]):
            seen = (ids, positions, slots, seq_lens, tables)
            views = [tensor.numpy() for tensor in seen]
            self._views = (seen, views)
        size, width = views[3].shape[0], views[4].shape[1]
        if size == 0 or batch.max_query_len != 1 or views[0].shape[0] != size or size > self._max_rows \
                or width > self._max_width:
            return False
        host = self._host
        host[0][:size] = views[0]
        host[1][:size] = views[1]
        host[2][:size] = views[2]
        host[3][:size] = views[3]
        self._host_tables[:size, :width] = views[4]
        return True

    def _record(self, size: int) -> torch.Tensor:
        """Run the step eagerly on the static buffers, noting it; its output is this step's result."""
        keep: list[torch.Tensor] = []
        # (the recording of the forward alone, its output) when the head follows
        forward_only = None
        with torch.inference_mode(), replay.recording() as recorder, _WatchTorchOps(recorder, keep) as watch:
            out = self.forward(self.static_batch(size))
            if self.head is not None and isinstance(out, torch.Tensor):
                if recorder.refused is None:
                    forward_only = replay.StepRecording()
                    forward_only.program, forward_only.names = list(recorder.program), list(recorder.names)
                    forward_only = (forward_only, out)
                out = self.head(out)
        if not isinstance(out, torch.Tensor):
            recorder.refuse(f"the forward returned {type(out).__name__}, not a tensor")
        if recorder.refused is not None and forward_only is not None:  # the head refused: replay the forward
            logger.debug("cpu decode replay: the LM head of batches of %d runs eagerly (%s)", size, recorder.refused)
            logits, (recorder, hidden) = out, forward_only
            self.eager_head.add(size)
            self._keep(size, recorder, hidden, keep, watch.new_bytes)
            return logits
        self._keep(size, recorder, out, keep, watch.new_bytes)
        return out

    def _keep(self, size: int, recorder: replay.StepRecording, out: torch.Tensor, keep: list[torch.Tensor],
              new_bytes: int) -> None:
        """Keep the recording of ``size`` as its program, or note that size eager (refused, or past the budget)."""
        if self.held_bytes + new_bytes > self.memory_budget:
            recorder.refuse(f"its recording would hold {new_bytes / 2**20:.1f} MiB, past the "
                            f"{self.memory_budget / 2**20:.0f} MiB the recordings may hold ({self.held_bytes / 2**20:.1f} "
                            "MiB held)")
        if recorder.refused is not None:
            logger.debug("cpu decode replay: batches of %d stay eager (%s)", size, recorder.refused)
            self.programs[size] = None
        else:
            self.programs[size] = (replay.StepProgram(recorder), out, keep)
            self.held_bytes += new_bytes

    def __call__(self, batch: ForwardBatch) -> torch.Tensor | None:
        """This decode step's hidden states ``[num_seqs, hidden]`` (with a ``head``: its logits) from a replay
        (or from the recording run on the static buffers), or None: run it eagerly. The result is the
        recording's own output tensor, written again by the next replay of this size."""
        size = batch.num_seqs
        if self.programs.get(size, ...) is None or not self._load(batch):
            return None
        recorded = self.programs.get(size)
        if recorded is None:
            seen = self._eager_seen.get(size, 0)
            if seen < self.eager_steps:
                self._eager_seen[size] = seen + 1
                return None
            return self._record(size)
        program, out, _ = recorded
        program.run()
        self.replays += 1
        if size in self.eager_head:
            with torch.inference_mode():  # the worker calls a replay outside it
                return self.head(out)
        return out
