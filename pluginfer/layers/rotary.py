"""Rotary position embeddings: default, linear, dynamic (NTK) and llama3 scaling; per-frequency divisors
(``rope_scaling.frequency_factors``, a GGUF file's ``rope_freqs``) on top of default, linear or llama3.

Frequencies follow Hugging Face ``modeling_rope_utils`` so logits match transformers.
cos/sin are looked up once per step and shared by every layer using the same module.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from pluginfer.core.batch import ForwardBatch
from pluginfer.layers.context import backend_op, current_context, has_context

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3")


def rope_parameters(hf_config: dict) -> tuple[float, dict]:
    """(rope_theta, scaling dict with 'rope_type') from either config style (rope_scaling or rope_parameters)."""
    params = dict(hf_config.get("rope_parameters") or {})
    scaling = dict(hf_config.get("rope_scaling") or {})
    theta = hf_config.get("rope_theta", params.get("rope_theta", 10000.0))
    merged = {**params, **scaling}
    merged.pop("rope_theta", None)
    merged["rope_type"] = merged.get("rope_type", merged.get("type", "default"))
    return float(theta), merged


def _base_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


def frequency_factors(factors: object, rotary_dim: int) -> torch.Tensor:
    """``rope_scaling.frequency_factors``: one divisor per frequency, as given (a GGUF file's ``rope_freqs``
    tensor; llama.cpp divides each frequency by it, whatever scaling produced it)."""
    divisors = torch.as_tensor(factors, dtype=torch.float32).reshape(-1)
    if divisors.numel() != rotary_dim // 2 or not bool(torch.isfinite(divisors).all() and (divisors > 0).all()):
        raise ValueError(f"rope_scaling.frequency_factors: expected {rotary_dim // 2} positive finite divisors "
                         f"(one per rotary frequency), got {divisors.numel()} values")
    return divisors


class RotaryEmbedding(nn.Module):
    """Applies rope to the first ``rotary_dim`` features of q and k.

    ``is_neox_style``: rotate the two halves (neox/llama); False rotates adjacent pairs (GPT-J, GLM).
    """

    def __init__(self, head_dim: int, rotary_dim: int, max_position: int, base: float,
                 scaling: dict | None = None, original_max_position: int | None = None,
                 is_neox_style: bool = True) -> None:
        super().__init__()
        scaling = dict(scaling or {"rope_type": "default"})
        self.rope_type = scaling.get("rope_type", "default")
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope_scaling.rope_type: unsupported value {self.rope_type!r} "
                             f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
        self.head_dim, self.rotary_dim, self.base = head_dim, rotary_dim, base
        self.factor = float(scaling.get("factor", 1.0))
        self.original_max_position = original_max_position or max_position
        inv_freq = _base_inv_freq(base, rotary_dim)
        if self.rope_type == "linear":
            inv_freq = inv_freq / self.factor
        elif self.rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        if scaling.get("frequency_factors") is not None:
            if self.rope_type == "dynamic":
                raise ValueError("rope_scaling.frequency_factors: not supported with rope_type 'dynamic'")
            inv_freq = inv_freq / frequency_factors(scaling["frequency_factors"], rotary_dim)
        self.inv_freq = inv_freq
        positions = torch.arange(max_position, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]
        self.cos_cache, self.sin_cache = freqs.cos(), freqs.sin()
        self.is_neox_style = is_neox_style
        op_name = "rotary_neox" if is_neox_style else "rotary_interleaved"  # ops of layers/ops.py
        self.kernel = backend_op(current_context().backend, op_name) if has_context() else None

    def _tables(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 cos/sin of ``[tokens, rotary_dim / 2]`` for this step (shared by every layer)."""
        key = ("rope", id(self))
        if key not in batch.extras:
            if self.rope_type == "dynamic":
                freqs = self._dynamic_freqs(batch)
                batch.extras[key] = (freqs.cos(), freqs.sin())
            else:
                batch.extras[key] = (self.cos_cache[batch.positions], self.sin_cache[batch.positions])
        return batch.extras[key]

    def _cos_sin(self, batch: ForwardBatch, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        key = ("rope", id(self), dtype)
        if key not in batch.extras:
            cos, sin = self._tables(batch)
            batch.extras[key] = (cos.to(dtype).unsqueeze(1), sin.to(dtype).unsqueeze(1))
        return batch.extras[key]

    def _dynamic_freqs(self, batch: ForwardBatch) -> torch.Tensor:
        """NTK base grown with each sequence's length, as transformers does per forward. Computed from the
        batch's own tensors on their device, with no host list turned into a tensor (a copy from pageable host
        memory is refused inside a CUDA graph's capture)."""
        device = batch.positions.device
        tokens = torch.arange(batch.positions.shape[0], device=device)
        rows = torch.searchsorted(batch.query_start_loc[1:], tokens, right=True)  # each token's sequence
        lengths = batch.seq_lens[rows].double()
        limit = self.original_max_position
        scale = (self.factor * lengths.clamp(min=limit) / limit) - (self.factor - 1)
        bases = self.base * scale ** (self.rotary_dim / (self.rotary_dim - 2))
        exponents = torch.arange(0, self.rotary_dim, 2, dtype=torch.int64, device=device).float() / self.rotary_dim
        inv_freq = 1.0 / (bases.float()[:, None] ** exponents[None, :])
        return batch.positions.float()[:, None] * inv_freq

    def forward(self, batch: ForwardBatch, query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """query ``[tokens, heads, head_dim]``, key ``[tokens, kv_heads, head_dim]``; may rotate in place."""
        if self.kernel is not None and self.kernel(query, key, *self._tables(batch), self.rotary_dim):
            return query, key
        cos, sin = self._cos_sin(batch, query.dtype)
        return self._rotate(query, cos, sin), self._rotate(key, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.is_neox_style:
            half = self.rotary_dim // 2
            x1, x2 = x[..., :half], x[..., half:self.rotary_dim]
            rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        else:
            x1, x2 = x[..., 0:self.rotary_dim:2], x[..., 1:self.rotary_dim:2]
            rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        if self.rotary_dim == self.head_dim:
            return rotated
        return torch.cat((rotated, x[..., self.rotary_dim:]), dim=-1)


def get_rope(hf_config: dict, head_dim: int, rotary_dim: int | None = None,
             max_position: int | None = None, is_neox_style: bool = True, yarn: bool = False) -> RotaryEmbedding:
    """Build the rotary embedding an HF config asks for; unknown scaling types are an error.

    ``yarn``: the family accepts ``rope_type: yarn``, as transformers' model of it applies
    ``_compute_yarn_parameters`` (compared for llama, mistral, qwen2, qwen3 and qwen3-moe; the others still refuse
    it).
    """
    theta, scaling = rope_parameters(hf_config)
    config_max = hf_config.get("max_position_embeddings", 4096)
    if yarn and scaling["rope_type"] == "yarn":
        return YarnRotaryEmbedding(head_dim, rotary_dim or head_dim, max(max_position or 0, config_max), theta,
                                   yarn_scaling(hf_config), config_max, is_neox_style=is_neox_style)
    return RotaryEmbedding(head_dim, rotary_dim or head_dim, max(max_position or 0, config_max), theta, scaling,
                           original_max_position=config_max, is_neox_style=is_neox_style)


def partial_rotary_dim(hf_config: dict, head_dim: int, default_factor: float = 1.0) -> int:
    """``head_dim * partial_rotary_factor``, the factor read at the top level or in rope_parameters."""
    factor = hf_config.get("partial_rotary_factor")
    if factor is None:
        factor = (hf_config.get("rope_parameters") or {}).get("partial_rotary_factor", default_factor)
    if not isinstance(factor, (int, float)) or not 0 < factor <= 1:
        raise ValueError(f"config.json: partial_rotary_factor must be in (0, 1], got {factor!r}")
    rotary_dim = int(head_dim * factor)
    if rotary_dim % 2:
        raise ValueError(f"config.json: partial_rotary_factor {factor} gives an odd rotary dimension {rotary_dim} "
                         f"(head_dim {head_dim})")
    return rotary_dim


class LongRopeEmbedding(RotaryEmbedding):
    """Phi-3's LongRoPE (``longrope``, formerly ``su``): per-frequency short or long factors, cos/sin scaled.

    One set of factors serves the whole run, chosen as vLLM does: the long ones when ``max_model_len``
    exceeds ``original_max_position``, else the short ones. transformers picks per forward by the sequence's
    length (its generate() even recomputes the cache when a sequence crosses over), which a paged cache with
    shared prefixes cannot follow; the two agree whenever every sequence stays on the side this run chose.
    """

    def __init__(self, head_dim: int, rotary_dim: int, max_position: int, base: float, scaling: dict,
                 original_max_position: int, max_position_embeddings: int, max_model_len: int) -> None:
        super().__init__(head_dim, rotary_dim, max_position, base, original_max_position=original_max_position)
        self.rope_type = "longrope"
        self.use_long_factors = max_model_len > original_max_position
        field = "long_factor" if self.use_long_factors else "short_factor"
        for name in ("short_factor", "long_factor"):
            value = scaling.get(name)
            if not isinstance(value, (list, tuple)) or len(value) != rotary_dim // 2:
                raise ValueError(f"rope_scaling.{name}: longrope needs a list of {rotary_dim // 2} numbers "
                                 f"(rotary_dim / 2), got {value!r}")
        factor = scaling.get("factor") or max_position_embeddings / original_max_position
        attention_factor = scaling.get("attention_factor")
        if attention_factor is None:  # the paper's default, as transformers computes it
            attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original_max_position))
        exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
        self.inv_freq = 1.0 / (torch.tensor(scaling[field], dtype=torch.float32) * base**exponents)
        freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * self.inv_freq[None, :]
        self.cos_cache, self.sin_cache = freqs.cos() * attention_factor, freqs.sin() * attention_factor


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 * mscale * ln(scale) + 1`` (1 when not stretched)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_scaling(hf_config: dict) -> dict:
    """The yarn parameters of a config; a top-level ``original_max_position_embeddings`` wins over the one in
    rope_scaling, as transformers' ``standardize_rope_params`` has it."""
    _, scaling = rope_parameters(hf_config)
    if hf_config.get("original_max_position_embeddings"):
        scaling["original_max_position_embeddings"] = hf_config["original_max_position_embeddings"]
    return scaling


def yarn_factor(scaling: dict, max_position_embeddings: int) -> tuple[float, int]:
    """(factor, original_max_position_embeddings) as transformers reads them: a missing factor is the ratio."""
    original = int(scaling.get("original_max_position_embeddings") or max_position_embeddings)
    factor = scaling.get("factor")
    return (float(factor) if factor is not None else max_position_embeddings / original), original


class YarnRotaryEmbedding(RotaryEmbedding):
    """YaRN (``rope_type: yarn``) as transformers' ``_compute_yarn_parameters``: frequencies blended between
    interpolated and extrapolated by a ramp over ``beta_fast``/``beta_slow`` rotations, cos/sin multiplied by
    ``attention_factor`` (default from ``factor``, ``mscale`` and ``mscale_all_dim``).

    Families opt in: DeepSeek builds it, llama, qwen and qwen3-moe pass ``yarn=True`` to ``get_rope``; the others
    still reject yarn, their transformers implementation not compared.
    """

    def __init__(self, head_dim: int, rotary_dim: int, max_position: int, base: float, scaling: dict,
                 max_position_embeddings: int, is_neox_style: bool = True) -> None:
        super().__init__(head_dim, rotary_dim, max_position, base, is_neox_style=is_neox_style)
        self.rope_type = "yarn"
        factor, original = yarn_factor(scaling, max_position_embeddings)
        self.factor, self.original_max_position = factor, original
        attention_factor = scaling.get("attention_factor")
        if attention_factor is None:
            mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
            if mscale and mscale_all_dim:
                attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
            else:
                attention_factor = yarn_mscale(factor)
        beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1
        dim = rotary_dim

        def correction_dim(rotations: float) -> float:
            return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        if scaling.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # as transformers: no zero-width ramp
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        pos_freqs = base ** (torch.arange(0, dim, 2).to(torch.float32) / dim)
        extrapolation = 1 - ramp
        self.inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
        freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * self.inv_freq[None, :]
        self.attention_factor = float(attention_factor)
        self.cos_cache, self.sin_cache = freqs.cos() * attention_factor, freqs.sin() * attention_factor
