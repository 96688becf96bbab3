"""Read a ``.gguf`` file (llama.cpp's format) as a checkpoint: an HF-style config and named weights.

Metadata becomes the ``config.json`` our model plugins already accept; ``blk.N.attn_q.weight``
becomes ``model.layers.N.self_attn.q_proj.weight`` (gguf-py's own name map, inverted);
llama's q/k rows are put back in Hugging Face order. Quantized tensors stay in their raw GGML
blocks (``GGMLTensor``, memory-mapped from the file) for the ``gguf`` quant method; the
embedding table and the LM head are dequantized at load because they are looked up / used
as dense tensors (see docs/quantization.md).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

# GGUF general.architecture -> the Hugging Face architecture our model plugins know.
SUPPORTED_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

# The HF modules of the llama/qwen families; gguf-py maps each to its GGUF name, we invert that.
_HF_MODULES = (
    "model.embed_tokens", "model.norm", "lm_head",
    "model.layers.{bid}.input_layernorm", "model.layers.{bid}.post_attention_layernorm",
    "model.layers.{bid}.self_attn.q_proj", "model.layers.{bid}.self_attn.k_proj",
    "model.layers.{bid}.self_attn.v_proj", "model.layers.{bid}.self_attn.o_proj",
    "model.layers.{bid}.self_attn.q_norm", "model.layers.{bid}.self_attn.k_norm",
    "model.layers.{bid}.mlp.gate_proj", "model.layers.{bid}.mlp.up_proj", "model.layers.{bid}.mlp.down_proj",
)
# llama.cpp's per-frequency rope divisors (llama3 rope scaling); no HF tensor, the config's rope_scaling.
_ROPE_FREQS = "rope_freqs.weight"
# Used as dense tensors by the embedding / LM head layers: dequantized while loading.
DENSE_TENSORS = ("model.embed_tokens.weight", "lm_head.weight")


def is_gguf_file(path: str | Path) -> bool:
    path = Path(path)
    return path.suffix.lower() == ".gguf" and path.is_file()


@dataclass(frozen=True)
class GGMLTensor:
    """A quantized checkpoint tensor kept as llama.cpp stores it.

    ``raw``: uint8 ``[rows, row_bytes]`` (GGML blocks along each row; memory-mapped from the file
    until something copies it); ``qtype``: a ``gguf.GGMLQuantizationType``; ``shape``: the logical
    ``[rows, cols]`` (Hugging Face's ``[out_features, in_features]``); ``name``: the GGUF tensor name.
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


class GGUFCheckpoint:
    """One ``.gguf`` file: metadata, tensor names, the HF config and the weight stream."""

    def __init__(self, path: str | Path) -> None:
        from gguf import GGUFReader

        self.path = Path(path)
        try:
            self.reader = GGUFReader(self.path, "c")  # copy-on-write map: torch can wrap it without a copy
        except Exception as exc:
            raise ValueError(f"{self.path} is not a readable GGUF file: {type(exc).__name__}: {exc}") from None
        self.arch = str(self.field("general.architecture", ""))
        if self.arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"{self.path}: GGUF architecture {self.arch!r} is not supported "
                             f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
        self.tensors = {tensor.name: tensor for tensor in self.reader.tensors}

    def field(self, key: str, default: Any = None) -> Any:
        """A metadata value; ``{arch}`` in ``key`` is this file's architecture."""
        field = self.reader.get_field(key.format(arch=getattr(self, "arch", "")))
        return default if field is None else field.contents()

    def require(self, key: str) -> Any:
        value = self.field(key)
        if value is None:
            raise ValueError(f"{self.path}: GGUF metadata {key.format(arch=self.arch)!r} is missing")
        return value

    def hf_config(self) -> dict:
        """The config.json a Hugging Face checkpoint of this model would have."""
        heads = int(self.require("{arch}.attention.head_count"))
        hidden = int(self.require("{arch}.embedding_length"))
        head_dim = int(self.field("{arch}.attention.key_length") or hidden // heads)
        value_dim = int(self.field("{arch}.attention.value_length") or head_dim)
        rope_dim = int(self.field("{arch}.rope.dimension_count") or head_dim)
        if value_dim != head_dim or rope_dim != head_dim:
            raise ValueError(f"{self.path}: key_length {head_dim}, value_length {value_dim} and "
                             f"rope.dimension_count {rope_dim} differ; the {self.arch} pipeline needs them equal")
        tokens = self.field("tokenizer.ggml.tokens")
        config: dict[str, Any] = {
            "architectures": [SUPPORTED_ARCHITECTURES[self.arch]],
            "model_type": self.arch,
            "hidden_size": hidden,
            "num_hidden_layers": int(self.require("{arch}.block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(self.field("{arch}.attention.head_count_kv") or heads),
            "head_dim": head_dim,
            "intermediate_size": int(self.require("{arch}.feed_forward_length")),
            "rms_norm_eps": float(self.field("{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
            "rope_theta": float(self.field("{arch}.rope.freq_base", 10000.0)),
            "max_position_embeddings": int(self.field("{arch}.context_length", 2048)),
            "vocab_size": len(tokens) if tokens is not None else int(self.require("{arch}.vocab_size")),
            "hidden_act": "silu",
            "tie_word_embeddings": "output.weight" not in self.tensors,
            # Linear layers keep the file's block types; docs/quantization.md says why float32 by default.
            "torch_dtype": "float32",
            "quantization_config": {"quant_method": "gguf"},
        }
        has_bias = "blk.0.attn_q.bias" in self.tensors
        if self.arch in ("llama", "qwen3"):
            config["attention_bias"] = has_bias
        if self.arch == "llama":
            config["mlp_bias"] = "blk.0.ffn_up.bias" in self.tensors
        window = self.field("{arch}.attention.sliding_window")
        if window:
            if self.arch != "llama":
                raise ValueError(f"{self.path}: attention.sliding_window is supported for llama GGUF files only")
            config["sliding_window"] = int(window)
        for key, name in (("tokenizer.ggml.bos_token_id", "bos_token_id"), ("tokenizer.ggml.eos_token_id", "eos_token_id")):
            if self.field(key) is not None:
                config[name] = int(self.field(key))
        end_of_turn = self.field("tokenizer.ggml.eot_token_id")  # chat models end a turn with it (<|im_end|>)
        if end_of_turn is not None and int(end_of_turn) != config.get("eos_token_id"):
            config["eos_token_id"] = [i for i in (config.get("eos_token_id"), int(end_of_turn)) if i is not None]
        scaling = self._llama3_scaling(config["rope_theta"], head_dim) if _ROPE_FREQS in self.tensors \
            else self._rope_scaling()
        if scaling:
            config["rope_scaling"] = scaling
        return config

    def _rope_scaling(self) -> dict | None:
        kind = self.field("{arch}.rope.scaling.type")
        factor = self.field("{arch}.rope.scaling.factor")
        if kind in (None, "none") and not factor:
            return None
        if kind == "linear" or (kind is None and factor):
            return {"rope_type": "linear", "factor": float(factor)}
        if kind == "yarn":
            scaling = {"rope_type": "yarn", "factor": float(factor)}
            original = self.field("{arch}.rope.scaling.original_context_length")
            if original:
                scaling["original_max_position_embeddings"] = int(original)
            return scaling
        raise ValueError(f"{self.path}: rope scaling type {kind!r} is not supported (supported: linear, yarn)")

    def _llama3_scaling(self, theta: float, head_dim: int) -> dict:
        """llama3 rope scaling from the ``rope_freqs`` factors llama.cpp's converter computed from it.

        The factor is the largest one; low/high frequency factors 1 and 4 and an original context of
        8192 (or the file's) are Llama 3.1's, and the factors must come out the same, else it is an error.
        """
        factors = torch.from_numpy(np.array(self.tensors[_ROPE_FREQS].data, dtype=np.float32)).reshape(-1)
        original = int(self.field("{arch}.rope.scaling.original_context_length") or 8192)
        scaling = {"rope_type": "llama3", "factor": float(factors.max()), "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": original}
        if factors.numel() != head_dim // 2 or not torch.allclose(llama3_rope_factors(theta, head_dim, scaling),
                                                                  factors, rtol=1e-5, atol=0):
            raise ValueError(f"{self.path}: tensor {_ROPE_FREQS!r} holds rope factors that match no llama3 rope "
                             f"scaling (low/high frequency factors 1 and 4, original context {original})")
        return scaling

    def hf_names(self) -> dict[str, str]:
        """GGUF tensor name -> Hugging Face name, for every tensor in the file (unknown ones are errors)."""
        import gguf

        arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == self.arch)
        blocks = int(self.require("{arch}.block_count"))
        name_map = gguf.get_tensor_name_map(arch, blocks)
        to_hf = {}
        for module in _HF_MODULES:
            for bid in range(blocks) if "{bid}" in module else (None,):
                hf = module.format(bid=bid)
                gguf_name = name_map.get_name(hf)
                if gguf_name is not None:
                    to_hf[gguf_name] = hf
        names = {}
        for tensor_name in self.tensors:
            if tensor_name == _ROPE_FREQS:  # read into the config's rope scaling
                continue
            base, _, suffix = tensor_name.rpartition(".")
            if base not in to_hf or suffix not in ("weight", "bias"):
                raise KeyError(f"{self.path}: GGUF tensor {tensor_name!r} has no counterpart in the "
                               f"{self.arch} pipeline")
            names[tensor_name] = f"{to_hf[base]}.{suffix}"
        return names

    def iter_weights(self, progress: bool | None = None) -> Iterator[tuple[str, torch.Tensor | GGMLTensor]]:
        """(Hugging Face name, tensor): plain tensors for float types, ``GGMLTensor`` for block types."""
        from tqdm import tqdm

        names = self.hf_names()
        config = self.hf_config()
        heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
        with tqdm(total=len(self.tensors), desc="Loading GGUF", unit="tensor",
                  disable=None if progress is None else not progress, leave=False) as bar:
            for tensor_name, tensor in self.tensors.items():
                if tensor_name not in names:
                    continue
                hf_name = names[tensor_name]
                loaded = self._tensor(tensor)
                if hf_name in DENSE_TENSORS and isinstance(loaded, GGMLTensor):
                    loaded = loaded.dequantize(torch.float32)
                projection = hf_name.split(".")[-2]
                if self.arch == "llama" and projection in heads:
                    loaded = _unpermute_rows(loaded, heads[projection])
                yield hf_name, loaded
                bar.update()

    def _tensor(self, tensor: Any) -> torch.Tensor | GGMLTensor:
        from gguf import GGMLQuantizationType as T

        shape = torch.Size(int(d) for d in reversed(tensor.shape.tolist()))  # GGML lists the fastest axis first
        data = tensor.data
        if tensor.tensor_type in (T.F32, T.F16):
            return torch.from_numpy(data).reshape(shape)
        if tensor.tensor_type == T.BF16:
            return torch.from_numpy(data.view(np.int16)).view(torch.bfloat16).reshape(shape)
        if len(shape) != 2:
            raise ValueError(f"GGUF tensor {tensor.name!r}: {tensor.tensor_type.name} tensor of shape "
                             f"{tuple(shape)}; only 2-D tensors may be block-quantized")
        return GGMLTensor(torch.from_numpy(data).reshape(shape[0], -1), tensor.tensor_type, shape, tensor.name)


def _unpermute_rows(loaded: torch.Tensor | GGMLTensor, num_heads: int) -> torch.Tensor | GGMLTensor:
    """Undo llama.cpp's ``permute`` of q/k rows (per head: interleaved halves -> HF's rotate-half order).

    It moves whole rows, so it applies to a quantized tensor's rows of blocks as well.
    """
    rows = loaded.shape[0]
    if rows % (2 * num_heads):
        raise ValueError(f"q/k tensor of {rows} rows is not {num_heads} heads of an even size")
    permuted = torch.arange(rows).reshape(num_heads, 2, rows // num_heads // 2).transpose(1, 2).reshape(-1)
    inverse = torch.argsort(permuted)
    if isinstance(loaded, GGMLTensor):
        return GGMLTensor(loaded.raw[inverse], loaded.qtype, loaded.shape, loaded.name)
    return loaded[inverse]


def permute_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's ``permute`` (convert_hf_to_gguf.py): HF q/k rows -> the order GGUF llama files use."""
    rows = weight.shape[0]
    permuted = torch.arange(rows).reshape(num_heads, 2, rows // num_heads // 2).transpose(1, 2).reshape(-1)
    return weight[permuted]


def llama3_rope_factors(theta: float, head_dim: int, scaling: dict) -> torch.Tensor:
    """The ``rope_freqs`` divisors llama.cpp's converter writes for llama3 rope scaling (its float32 steps)."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    factors = []
    for freq in freqs.tolist():
        wavelength = 2 * math.pi / freq
        if wavelength < original / high:
            factors.append(1.0)
        elif wavelength > original / low:
            factors.append(factor)
        else:
            smooth = (original / wavelength - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32)


def read_gguf_config(path: str | Path) -> dict:
    return GGUFCheckpoint(path).hf_config()


def iter_gguf_weights(path: str | Path, progress: bool | None = None) -> Iterator[tuple[str, Any]]:
    yield from GGUFCheckpoint(path).iter_weights(progress)
