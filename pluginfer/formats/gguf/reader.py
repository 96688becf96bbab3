"""The metadata and tensor table of a ``.gguf`` file, read in one pass over its header.

gguf-py's ``GGUFReader`` builds numpy views for every element of every metadata array: a 49k-token
vocabulary with its merges, scores and token types takes it seconds, where this reader walks the
header with ``struct`` in tens of milliseconds and decodes an array
only when it is asked for. Tensors are numpy views of the file mapped copy-on-write (torch can wrap
them without a copy), shaped as gguf-py shapes them; each tensor's header entry is checked before its
view is made (``check_tensor_info``). Little-endian files (what llama.cpp writes), versions 2 and 3.
"""

from __future__ import annotations

import mmap
import os
import struct
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_MAGIC = 0x46554747  # b"GGUF" read as a little-endian uint32
_STRING, _ARRAY = 8, 9
# GGUF value type -> struct format of one scalar (8 string and 9 array are read apart)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_DEFAULT_ALIGNMENT = 32
_OPEN_FILES: weakref.WeakSet[GGUFFile] = weakref.WeakSet()  # for file_holding: which mapping holds an address


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor of the file: ``shape`` lists GGML's dimensions (fastest first); ``data`` is the mapped
    bytes as gguf-py gives them (float and integer types as their dtype in numpy's order, block types as
    uint8 rows of whole blocks)."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    data_offset: int
    n_bytes: int
    data: np.ndarray


class GGUFFile:
    """``fields`` (metadata key -> value) and ``tensors`` (in the file's order) of one ``.gguf`` file."""

    def __init__(self, path: str | Path, tensors: bool = True) -> None:
        """``tensors=False``: the metadata alone (``tensors`` stays empty), with nothing imported that imports
        torch (the API server reads a file's tokenizer this way)."""
        self.path = Path(path)
        with open(self.path, "rb") as file:
            self._map = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY)  # private: writes never reach the file
        self.data = np.frombuffer(self._map, dtype=np.uint8)
        self.address = self.data.ctypes.data  # where the mapping starts in this process
        self._buffer = memoryview(self.data)
        self._arrays: dict[str, tuple[int, int, int]] = {}  # key -> (element type, count, offset), decoded on demand
        self._decoded: dict[str, Any] = {}
        offset = 0
        try:
            magic, version = self._u32(0), self._u32(4)
            if magic != _MAGIC:
                raise ValueError("GGUF magic invalid")
            if version not in (2, 3):
                raise ValueError(f"Sorry, file appears to be version {version} which we cannot handle")
            n_tensors, n_fields = self._u64(8), self._u64(16)
            offset = 24
            self.fields: dict[str, Any] = {}
            for _ in range(n_fields):
                key, offset = self._string(offset)
                kind, offset = self._u32(offset), offset + 4
                if key in self.fields or key in self._arrays:
                    raise ValueError(f"metadata key {key!r} appears twice")
                offset = self._read_value(key, kind, offset)
            entries = []
            for _ in range(n_tensors):
                name, offset = self._string(offset)
                n_dims, offset = self._u32(offset), offset + 4
                dims = tuple(self._u64(offset + 8 * i) for i in range(n_dims))
                offset += 8 * n_dims
                raw_type, relative = self._u32(offset), self._u64(offset + 4)
                offset += 12
                entries.append((name, dims, raw_type, relative))
        except (struct.error, IndexError, UnicodeDecodeError) as exc:
            raise ValueError(f"the header breaks after byte {offset} of {len(self.data)}: "
                                  f"{type(exc).__name__}: {exc}") from None
        self.tensors: list[GGUFTensorInfo] = []
        if not tensors:
            return
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        from pluginfer.formats.gguf.checkpoint import check_tensor_info

        alignment = int(self.get("general.alignment", _DEFAULT_ALIGNMENT))
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"general.alignment {alignment} is not a positive power of two")
        start = -(-offset // alignment) * alignment
        names: set[str] = set()
        for name, dims, raw_type, relative in entries:
            if name in names:
                raise ValueError(f"Found duplicated tensor with name {name}")
            names.add(name)
            check_tensor_info(name, list(dims), raw_type, start + relative, len(self.data))
            qtype = GGMLQuantizationType(raw_type)
            block, type_size = GGML_QUANT_SIZES[qtype]
            n_bytes = int(np.prod(dims, dtype=object)) // block * type_size
            numpy_shape = tuple(reversed(dims))
            dtype = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                     "I32": np.int32, "I64": np.int64}.get(qtype.name)
            if dtype is None:  # block types (BF16 too): rows of bytes, as gguf-py has them
                dtype, numpy_shape = np.uint8, (*numpy_shape[:-1], numpy_shape[-1] // block * type_size)
            data = self.data[start + relative:start + relative + n_bytes].view(dtype).reshape(numpy_shape)
            self.tensors.append(GGUFTensorInfo(name, qtype, dims, start + relative, n_bytes, data))
        _OPEN_FILES.add(self)
        self._descriptor: int | None = None  # for read_into, opened on first use

    def read_into(self, start: int, target: memoryview) -> None:
        """Read file bytes ``[start, start + len(target))`` into ``target`` with ``pread``, not through the
        mapping: the file's pages stay in the OS's page cache and never enter this process (and no page
        fault per 4 KiB, several times faster than copying from the mapping on a busy machine)."""
        if self._descriptor is None:
            self._descriptor = os.open(self.path, os.O_RDONLY)
            weakref.finalize(self, os.close, self._descriptor)
        done = 0
        while done < len(target):
            count = os.preadv(self._descriptor, [target[done:]], start + done)
            if count <= 0:
                raise OSError(f"{self.path}: reading {len(target)} bytes at {start} stopped after {done}: the file "
                              "is shorter than its header says (changed on disk while open?)")
            done += count

    def release(self, start: int, length: int) -> int:
        """Drop the pages wholly inside bytes ``[start, start + length)`` of the file from this process's
        mapping (``MADV_DONTNEED``); the bytes released (0 where the OS has no such call).

        For what was copied out of the file: the pages leave this process's resident memory and stay in
        the OS's page cache, and a later read of them maps them again with the file's bytes (the mapping
        is private and never written, so nothing is lost)."""
        page = mmap.PAGESIZE
        first, end = -(-start // page) * page, min(start + length, len(self.data)) // page * page
        if end <= first or not hasattr(mmap, "MADV_DONTNEED"):
            return 0
        self._map.madvise(mmap.MADV_DONTNEED, first, end - first)
        return end - first

    def get(self, key: str, default: Any = None) -> Any:
        """A metadata value (str, int, float, bool, or a list of them); ``default`` if the file has none."""
        if key in self.fields:
            return self.fields[key]
        if key not in self._arrays:
            return default
        if key not in self._decoded:
            self._decoded[key] = self._decode_array(*self._arrays[key])
        return self._decoded[key]

    def array_length(self, key: str) -> int | None:
        """How many elements the metadata array ``key`` holds, without decoding it (a vocabulary's size
        without its strings); None for a key that is not an array."""
        found = self._arrays.get(key)
        return None if found is None else found[1]

    def __contains__(self, key: str) -> bool:
        return key in self.fields or key in self._arrays

    # -- reading the header ---------------------------------------------------------------------

    def _u32(self, offset: int) -> int:
        return _U32.unpack_from(self._buffer, offset)[0]

    def _u64(self, offset: int) -> int:
        return _U64.unpack_from(self._buffer, offset)[0]

    def _string(self, offset: int) -> tuple[str, int]:
        length = self._u64(offset)
        end = offset + 8 + length
        if end > len(self.data):
            raise IndexError(f"a string of {length} bytes at byte {offset} runs past the end of the file")
        return bytes(self._buffer[offset + 8:end]).decode("utf-8"), end

    def _read_value(self, key: str, kind: int, offset: int) -> int:
        """Store ``key``'s value (an array is only located); the offset past it."""
        if kind == _STRING:
            self.fields[key], offset = self._string(offset)
            return offset
        if kind in _SCALARS:
            scalar = struct.Struct(_SCALARS[kind])
            self.fields[key] = scalar.unpack_from(self._buffer, offset)[0]
            return offset + scalar.size
        if kind != _ARRAY:
            raise ValueError(f"metadata {key!r} has the unknown value type {kind}")
        element, count = self._u32(offset), self._u64(offset + 4)
        offset += 12
        self._arrays[key] = (element, count, offset)
        if element == _STRING:
            unpack, buffer = _U64.unpack_from, self._buffer
            for _ in range(count):  # only the lengths are read here (a 49k-token vocabulary in ~3 ms)
                offset += 8 + unpack(buffer, offset)[0]
        elif element in _SCALARS:
            offset += struct.calcsize(_SCALARS[element]) * count
        else:
            raise ValueError(f"metadata {key!r} is an array of the unsupported value type {element}")
        if offset > len(self.data):
            raise IndexError(f"metadata {key!r} runs past the end of the file")
        return offset

    def _decode_array(self, element: int, count: int, offset: int) -> list:
        if element == _STRING:  # the header's walk checked that the array ends inside the file
            unpack, data, values = _U64.unpack_from, self._map, []
            append = values.append
            for _ in range(count):  # (the mapping's slices are bytes: half the time of _string's copies)
                start = offset + 8
                offset = start + unpack(data, offset)[0]
                append(data[start:offset].decode("utf-8"))
            return values
        return np.frombuffer(self._buffer, dtype=_NUMPY[element], count=count, offset=offset).tolist()


def file_holding(address: int, length: int) -> tuple[GGUFFile, int] | None:
    """The open file whose mapping holds bytes ``[address, address + length)`` of this process's memory, and
    the offset of ``address`` in it; None where no open file's mapping does (it is never another memory)."""
    for file in list(_OPEN_FILES):
        if file.address <= address and address + length <= file.address + len(file.data):
            return file, address - file.address
    return None
