"""Step recording: the native calls of one eager step noted as a program that ``csrc/step_replay.c`` runs
again in one C call (``step_replay.py``), and the library as the wrappers reach it (:func:`native`).
"""

from __future__ import annotations

import contextlib
import ctypes
import struct
import threading
from collections.abc import Callable, Iterator

import torch

from pluginfer.backends.cpu import library
from pluginfer.backends.cpu.library import REPLAY_SIGNATURES, SIGNATURES

# Kernels a recorded step may call, by their code in csrc/step_replay.c (its enum, in this order).
REPLAY_OPS = ("paged_decode_attention", "rms_norm", "silu_and_mul", "rotary_neox", "ggml_dequantize_rows",
              "panel_linear", "quant_matmul", "half_linear", "gather_rows", "scatter_rows", "add_f32", "to_f32",
              "copy_rows", "quant_matmul_at", "paged_decode_attention_16", "rms_norm_16", "silu_and_mul_16",
              "rotary_neox_16", "add_bf16", "add_f16", "half_linear_at", "half_weight_linear",
              "gelu_tanh_and_mul", "gelu_tanh_and_mul_16", "mul_scalar", "from_f32",
              "paged_decode_attention_kv16", "kv_quantize_rows", "paged_attention_quantized", "quant_panel_matmul",
              "int8_gemm_at", "half_panel_linear")
_REPLAY_CODES = {name: code for code, name in enumerate(REPLAY_OPS, start=1)}


class StepRecording:
    """The native calls of one eager step, as a program ``step_replay`` runs again in one C call.

    While it is active (:func:`recording`, in this thread) the kernel wrappers reach the library
    through it: each call runs as usual and is appended to :attr:`program` with its arguments (pointers
    as addresses: the caller keeps the tensors alive); a call of a kernel ``step_replay`` cannot run
    refuses the recording, and :attr:`refused` says which. :meth:`append` also takes the copy-like ops
    of ``csrc/step_replay.c`` that stand in for torch ops (``step_replay.py``)."""

    def __init__(self) -> None:
        self.program: list[int] = []
        self.names: list[str] = []
        self.refused: str | None = None

    def refuse(self, reason: str) -> None:
        if self.refused is None:
            self.refused = reason

    def append(self, name: str, *args: object) -> None:
        code = _REPLAY_CODES.get(name)
        if code is None:
            self.refuse(f"native {name} has no replay entry")
            return
        packed = [struct.unpack("<q", struct.pack("<d", value))[0] if kind is ctypes.c_float else int(value or 0)
                  for value, kind in zip(args, (SIGNATURES.get(name) or REPLAY_SIGNATURES[name])[1], strict=True)]
        self.program += [code, len(packed), *packed]
        self.names.append(name)

    def __getattr__(self, name: str) -> Callable:
        function = getattr(library.load(), name)

        def call(*args: object) -> object:
            result = function(*args)
            self.append(name, *args)
            return result

        return call


# .recording: the StepRecording of this thread, if one is active
_state = threading.local()


def active_recording() -> StepRecording | None:
    """This thread's active recording, or None."""
    return getattr(_state, "recording", None)


def native() -> ctypes.CDLL | StepRecording:
    """The library, or this thread's active recording in front of it (every kernel wrapper calls through this)."""
    recorder = getattr(_state, "recording", None)
    return library.load() if recorder is None else recorder


@contextlib.contextmanager
def recording() -> Iterator[StepRecording]:
    """Record the native calls made in this thread inside the block (see :class:`StepRecording`)."""
    if getattr(_state, "recording", None) is not None:
        raise RuntimeError("native calls are already being recorded in this thread")
    _state.recording = StepRecording()
    try:
        yield _state.recording
    finally:
        _state.recording = None


class StepProgram:
    """A finished recording, replayed by one call of ``step_replay`` (no Python between its kernels)."""

    def __init__(self, recorded: StepRecording) -> None:
        if recorded.refused is not None:
            raise ValueError(f"a refused recording cannot be replayed: {recorded.refused}")
        self.program = torch.tensor(recorded.program, dtype=torch.int64)
        self.names = list(recorded.names)
        self._status = ctypes.c_int64(0)
        # run()'s arguments, taken once: a torch call right after a replayed step's kernels is slow
        self._arguments = (self.program.data_ptr(), self.program.numel(), ctypes.addressof(self._status))

    def __len__(self) -> int:
        return len(self.names)

    def run(self) -> None:
        failed = library.load().step_replay(*self._arguments)
        if failed:
            raise RuntimeError(f"step replay: entry {failed - 1} ({self.names[failed - 1]}) failed with status "
                               f"{self._status.value}")


def record_at(recorder: StepRecording, kernel: object, *args: object, entry: str = "quant_matmul_at") -> None:
    """Note a call of another library's ctypes function as ``entry``: of quant_matmul's signature
    (``quant_matmul_at``), of half_linear's (``half_linear_at``) or of int8_gemm's (``int8_gemm_at``); its address,
    then its arguments. Anything
    else in its place (not a C function) refuses the recording."""
    try:
        address = ctypes.cast(kernel, ctypes.c_void_p).value
    except (ctypes.ArgumentError, TypeError):
        recorder.refuse(f"{kernel!r} is not a C function a replay can call")
        return
    recorder.append(entry, address, *args)

