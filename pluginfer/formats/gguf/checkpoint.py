"""Read a ``.gguf`` file (llama.cpp's format) as a checkpoint: an HF-style config and named weights.

What an architecture's metadata and tensors mean is the model plugin's: the spec whose
``converters["gguf"]`` holds the file's ``general.architecture`` names the function that turns
this checkpoint into a ``GGUFModel`` (the ``config.json`` its pipeline accepts, the HF modules whose
GGUF names gguf-py's name map gives, and any fix-up of tensors). Quantized tensors stay in their raw
GGML blocks (``GGMLTensor``, memory-mapped from the file) for the ``gguf`` quant method, the embedding
table and the LM head included (``layers.embedding`` keeps them quantized); an embedding or LM head stored
as F16/BF16 is handed over the same way (a ``GGMLTensor`` of its 16-bit rows: kept in the file's type, the
head run by the backend's 16-bit GEMV, instead of a float32 copy); only the tensors a model names in
``dense_tensors`` are dequantized at load (docs/quantization.md).

What is copied at load (rows reordered by a model's ``fix``, a dequantized tensor, the quant method's
fused groups) gives its file pages back (``release_file_pages``), or is read from the file without the
mapping (``read_file_bytes``, the fused groups): the process keeps resident one copy of each weight, the
file's pages for what it reads in place, its own memory for what it copied.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch


def is_gguf_file(path: str | Path) -> bool:
    """Whether ``path`` is a ``.gguf`` file: the ``claims`` of the built-in ``gguf`` checkpoint format."""
    path = Path(path)
    return path.suffix.lower() == ".gguf" and path.is_file()


@dataclass(frozen=True)
class GGMLTensor:
    """A quantized checkpoint tensor kept as llama.cpp stores it.

    ``raw``: uint8 ``[rows, row_bytes]`` (GGML blocks along each row; memory-mapped from the file
    until something copies it); ``qtype``: a ``gguf.GGMLQuantizationType``; ``shape``: the logical
    ``[rows, cols]`` (Hugging Face's ``[out_features, in_features]``); ``name``: the GGUF tensor name.
    A 3-D tensor (llama.cpp's merged experts) is ``[experts, rows, row_bytes]`` of ``[experts, rows, cols]``.
    """

    raw: torch.Tensor
    qtype: Any
    shape: torch.Size
    name: str

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense tensor (gguf-py's reference dequantization, on the CPU)."""
        from gguf import quants

        try:
            dense = quants.dequantize(self.raw.cpu().numpy(), self.qtype)
        except NotImplementedError:
            raise ValueError(f"GGUF tensor {self.name!r}: type {self.qtype.name} cannot be dequantized "
                             f"by gguf-py") from None
        return torch.from_numpy(np.ascontiguousarray(dense)).reshape(self.shape).to(dtype)


@dataclass
class GGUFModel:
    """What a model plugin's ``converters["gguf"]`` function makes of a GGUF file.

    ``hf_config``: the ``config.json`` of the same model; ``hf_modules``: HF module names (``{bid}`` for
    the block index) whose GGUF names gguf-py's name map gives; ``ignored_tensors``: GGUF tensors read
    into the config instead; ``dense_tensors``: HF names dequantized at load; ``fix``: ``(hf_name, tensor)
    -> tensor`` applied to each tensor (e.g. llama's q/k row order); ``expand``: ``(hf_name, tensor) ->
    [(hf_name, tensor), ...]`` after ``fix``, where one file tensor is several HF ones (merged experts) or
    joins another before it is one (held until then: an empty list).
    """

    hf_config: dict
    hf_modules: tuple[str, ...]
    ignored_tensors: tuple[str, ...] = ()
    dense_tensors: tuple[str, ...] = ()
    fix: Callable[[str, Any], Any] | None = field(default=None, repr=False)
    expand: Callable[[str, Any], Iterable[tuple[str, Any]]] | None = field(default=None, repr=False)


class GGUFCheckpoint:
    """One ``.gguf`` file: metadata, tensor names, and through its model plugin the HF config and weights."""

    def __init__(self, path: str | Path, registry: Any = None) -> None:
        from pluginfer.core.registry import UnknownPluginError, get_registry
        from pluginfer.formats.gguf.reader import GGUFFile

        self.path = Path(path)
        try:
            self.reader = GGUFFile(self.path)  # mapped copy-on-write: torch wraps its tensors, no copy
        except MalformedTensorError as exc:
            raise ValueError(f"{self.path}: {exc}") from None
        except Exception as exc:
            raise ValueError(f"{self.path} is not a readable GGUF file: {type(exc).__name__}: {exc}") from None
        self.arch = str(self.field("general.architecture", ""))
        self._registry = registry or get_registry()
        try:
            self._converter = self._registry.converter("gguf", self.arch)
        except UnknownPluginError as exc:
            raise ValueError(f"{self.path}: {exc}") from None
        self.tensors = {tensor.name: tensor for tensor in self.reader.tensors}

    def _architectures(self) -> str:
        """The GGUF architectures the registered model plugins read, for error messages."""
        from pluginfer.core.specs import ModelSpec

        return ", ".join(sorted({arch for spec in self._registry.specs("model") if isinstance(spec, ModelSpec)
                                 for arch in spec.converters.get("gguf", {})}))

    @cached_property
    def model(self) -> GGUFModel:
        """The model plugin's reading of this file."""
        return self._converter(self)

    def hf_config(self) -> dict:
        """The config.json a Hugging Face checkpoint of this model would have."""
        return self.model.hf_config

    def field(self, key: str, default: Any = None) -> Any:
        """A metadata value; ``{arch}`` in ``key`` is this file's architecture."""
        return self.reader.get(key.format(arch=getattr(self, "arch", "")), default)

    def array_length(self, key: str) -> int | None:
        """How many elements the metadata array ``key`` holds (``{arch}`` as in ``field``), without decoding it;
        None for a key that is not an array."""
        return self.reader.array_length(key.format(arch=getattr(self, "arch", "")))

    def require(self, key: str) -> Any:
        value = self.field(key)
        if value is None:
            raise ValueError(f"{self.path}: GGUF metadata {key.format(arch=self.arch)!r} is missing")
        return value

    def hf_names(self) -> dict[str, str]:
        """GGUF tensor name -> Hugging Face name, for every tensor in the file (unknown ones are errors)."""
        import gguf

        arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == self.arch)
        blocks = int(self.require("{arch}.block_count"))
        name_map = gguf.get_tensor_name_map(arch, blocks)
        to_hf = {}
        for module in self.model.hf_modules:
            for bid in range(blocks) if "{bid}" in module else (None,):
                hf = module.format(bid=bid)
                gguf_name = name_map.get_name(hf)
                if gguf_name is not None:
                    to_hf[gguf_name] = hf
        names = {}
        for tensor_name in self.tensors:
            if tensor_name in self.model.ignored_tensors:
                continue
            base, _, suffix = tensor_name.rpartition(".")
            if base not in to_hf or suffix not in ("weight", "bias"):
                raise KeyError(f"{self.path}: GGUF tensor {tensor_name!r} has no counterpart in the "
                               f"{self.arch} pipeline (GGUF architectures supported: {self._architectures()})")
            names[tensor_name] = f"{to_hf[base]}.{suffix}"
        return names

    def load_tokenizer(self) -> Any:
        from pluginfer.text.tokenizer import load_tokenizer

        return load_tokenizer(self.path)

    def iter_weights(self, progress: bool | None = None,
                     allow_pickle: bool = False) -> Iterator[tuple[str, torch.Tensor | GGMLTensor]]:
        """(Hugging Face name, tensor): plain tensors for float types, ``GGMLTensor`` for block types (a GGUF
        file holds no pickles: ``allow_pickle`` changes nothing)."""
        from tqdm import tqdm

        names = self.hf_names()
        model = self.model
        with tqdm(total=len(self.tensors), desc="Loading GGUF", unit="tensor",
                  disable=None if progress is None else not progress, leave=False) as bar:
            for tensor_name, tensor in self.tensors.items():
                if tensor_name not in names:
                    continue
                hf_name = names[tensor_name]
                loaded = self._tensor(tensor)
                source = _data(loaded)
                if hf_name in model.dense_tensors and isinstance(loaded, GGMLTensor):
                    loaded = loaded.dequantize(torch.float32)
                if model.fix is not None:
                    loaded = model.fix(hf_name, loaded)
                shared = False
                for name, kept in ((hf_name, loaded),) if model.expand is None else model.expand(hf_name, loaded):
                    shared = shared or shares_memory(_data(kept), source)
                    yield name, kept
                if not shared:  # copies only (dequantized, rows reordered): the file's pages can go
                    release_file_pages(source)
                bar.update()

    def _tensor(self, tensor: Any) -> torch.Tensor | GGMLTensor:
        from gguf import GGMLQuantizationType as T

        shape = torch.Size(int(d) for d in reversed(tensor.shape))  # GGML lists the fastest axis first
        data = tensor.data
        if tensor.tensor_type in (T.F16, T.BF16) and tensor.name in VOCAB_TABLES and len(shape) == 2:
            return GGMLTensor(torch.from_numpy(data.view(np.uint8)).reshape(shape[0], -1), tensor.tensor_type, shape,
                              tensor.name)
        if tensor.tensor_type in (T.F32, T.F16):
            return torch.from_numpy(data).reshape(shape)
        if tensor.tensor_type == T.BF16:
            return torch.from_numpy(data.view(np.int16)).view(torch.bfloat16).reshape(shape)
        if len(shape) not in (2, 3):
            raise ValueError(f"GGUF tensor {tensor.name!r}: {tensor.tensor_type.name} tensor of shape "
                             f"{tuple(shape)}; only 2-D tensors (3-D: merged experts) may be block-quantized")
        return GGMLTensor(torch.from_numpy(data).reshape(*shape[:-1], -1), tensor.tensor_type, shape, tensor.name)


# The GGUF names of the vocabulary tables (every architecture's ``token_embd`` and ``output``): stored as
# F16/BF16 they are handed over as ``GGMLTensor``s, as quantized ones are.
VOCAB_TABLES = frozenset({"token_embd.weight", "output.weight"})


def _data(loaded: torch.Tensor | GGMLTensor) -> torch.Tensor:
    return loaded.raw if isinstance(loaded, GGMLTensor) else loaded


def shares_memory(kept: torch.Tensor, source: torch.Tensor) -> bool:
    """Whether ``kept`` is ``source`` or a view of the same memory (not a copy of it)."""
    return kept.device == source.device and \
        kept.untyped_storage().data_ptr() == source.untyped_storage().data_ptr()


def release_file_pages(source: torch.Tensor) -> int:
    """Once a tensor read from an open ``.gguf`` file's mapping has been copied (a fused group, rows
    reordered, a rank's columns, another dtype or device), drop the file pages it was read from out of this
    process's resident memory; they stay in the OS's page cache, so they count once, there, not in every
    process that read them. Only pages wholly inside the tensor's bytes; a tensor that is not a view of an
    open file's mapping is left alone. The bytes released. Call it only when nothing reads ``source`` again
    (a read maps the pages back, with the file's bytes)."""
    from pluginfer.formats.gguf.reader import file_holding

    if source.device.type != "cpu" or source.numel() == 0:
        return 0
    extent = (sum((size - 1) * stride for size, stride in zip(source.shape, source.stride())) + 1) \
        * source.element_size()
    found = file_holding(source.data_ptr(), extent)
    return 0 if found is None else found[0].release(found[1], extent)


def read_file_bytes(source: torch.Tensor, target: torch.Tensor) -> bool:
    """Copy ``source``, a contiguous view of an open ``.gguf`` file's mapping, into ``target`` (contiguous, on
    the CPU, as many bytes) by reading the file (``GGUFFile.read_into``), so the source's pages never enter
    this process; False where ``source`` is no such view (copy it another way)."""
    from pluginfer.formats.gguf.reader import file_holding

    length = source.numel() * source.element_size()
    if source.device.type != "cpu" or target.device.type != "cpu" or not source.is_contiguous() \
            or not target.is_contiguous() or target.numel() * target.element_size() != length or length == 0:
        return False
    found = file_holding(source.data_ptr(), length)
    if found is None:
        return False
    found[0].read_into(found[1], memoryview(target.view(-1).view(torch.uint8).numpy()))
    return True


class MalformedTensorError(ValueError):
    """A tensor's entry in a GGUF file's header that no data can satisfy (named in the message)."""


def check_tensor_info(name: str, dims: list[int], raw_type: int, data_offset: int, file_size: int) -> None:
    """Refuse a tensor whose type is unknown, whose shape is not whole blocks, or whose data (``data_offset``,
    absolute) does not lie inside the file: before anything maps it, so no kernel reads past its bytes."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        qtype = GGMLQuantizationType(raw_type)
    except ValueError:
        known = ", ".join(t.name for t in GGMLQuantizationType)
        raise MalformedTensorError(f"GGUF tensor {name!r} has an unknown GGML type {raw_type} (known: {known})") \
            from None
    if not dims or any(d <= 0 for d in dims):
        raise MalformedTensorError(f"GGUF tensor {name!r} has the shape {dims}; every dimension must be positive")
    block, type_size = GGML_QUANT_SIZES[qtype]
    if dims[0] % block:
        raise MalformedTensorError(f"GGUF tensor {name!r}: rows of {dims[0]} weights are not whole {qtype.name} "
                                   f"blocks of {block}")
    n_bytes = int(np.prod(dims, dtype=object)) // block * type_size
    if data_offset + n_bytes > file_size:
        raise MalformedTensorError(
            f"GGUF tensor {name!r}: its {qtype.name} data of GGML shape {dims} takes {n_bytes} bytes from offset "
            f"{data_offset}, past the end of the file ({file_size} bytes): the file is truncated or the "
            "tensor's offset is wrong")


def read_gguf_config(path: str | Path) -> dict:
    return GGUFCheckpoint(path).hf_config()


def iter_gguf_weights(path: str | Path, progress: bool | None = None) -> Iterator[tuple[str, Any]]:
    yield from GGUFCheckpoint(path).iter_weights(progress)
