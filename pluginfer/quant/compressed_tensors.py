"""The ``compressed-tensors`` quant method: W8A8 int8 and FP8 checkpoints as llm-compressor writes them.

Served: ``int-quantized``, int8 weights per output channel, symmetric, with int8 activations per token,
symmetric and dynamic (W8A8); ``float-quantized``, float8 (e4m3) weights per output channel with float8
activations per token, dynamic (llm-compressor's FP8_DYNAMIC); any other scheme is an error naming it and the
config group it applies to. Activations are quantized as compressed-tensors' own forward does (int8: ``scale =
max|x| / 127.5``, half to even, ``[-128, 127]``; vLLM's kernels differ by a level at most; float8: ``scale =
max|x| / 448``, rounded to the nearest e4m3 value). The int8 matmul is two kernel-table ops, ``w8a8_pack`` (at
load) and ``w8a8_linear``, whose references below are exact on every device; the float8 one is ``fp8_linear``,
whose reference holds the weights as bfloat16 (every e4m3 value is one) for the backend's 16-bit linear.
"""

from __future__ import annotations

import re
from functools import partial

import torch
from torch import nn

from pluginfer.core.kernels import define_op
from pluginfer.core.protocols import ShardSpec
from pluginfer.layers.context import backend_op, current_context, has_context, quant_kernel
from pluginfer.quant.gguf import half_weight_linear
from pluginfer.quant.sharding import UNSPLIT
from pluginfer.quant.tiled import tiled_linear

FORMATS = {"int": "int-quantized", "float": "float-quantized"}  # a scheme's type -> the format it is saved in
FP8_MAX = 448.0  # the largest float8 e4m3 value
# float32 sums of up to 1024 products of int8 levels are exact integers (<= 2^24)
_EXACT_INPUTS = 1024


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float ``[m, k]`` -> (int8 levels ``[m, k]``, float32 scales ``[m]``): ``scale = max|row| / 127.5``,
    ``level = round_half_even(x / scale)`` clamped to ``[-128, 127]`` (an all-zero row: scale 0, levels 0)."""
    x = x.float()
    scale = x.abs().amax(dim=-1) / 127.5
    divisor = torch.where(scale == 0, torch.ones_like(scale), scale)
    return torch.round(x / divisor[:, None]).clamp_(-128, 127).to(torch.int8), scale


def int8_sums(levels: torch.Tensor, qweight: torch.Tensor) -> torch.Tensor:
    """int32 ``levels [m, k] @ qweight[n, k]^T``, exact on every device: float32 products summed over at most
    1024 inputs at a time (each partial sum an integer within 2^24), the parts added in int32."""
    total = None
    for start in range(0, levels.shape[1], _EXACT_INPUTS):
        part = levels[:, start:start + _EXACT_INPUTS].float() @ qweight[:, start:start + _EXACT_INPUTS].float().t()
        total = part.to(torch.int32) if total is None else total + part.to(torch.int32)
    return total


@define_op
def w8a8_pack(qweight: torch.Tensor) -> torch.Tensor:
    """int8 ``[n, k]`` weight (the checkpoint's) -> the layout this backend's :func:`w8a8_linear` reads; the
    reference keeps it as it is. Called once per layer at load; the result replaces the weight."""
    return qweight


@define_op
def w8a8_linear(x: torch.Tensor, packed: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                out_features: int) -> torch.Tensor:
    """``x @ W^T + bias`` for W8A8: ``packed`` from the same backend's :func:`w8a8_pack`, ``weight_scale``
    float32 ``[n]`` (``W ~= q * weight_scale[:, None]``). Each row of ``x`` (any leading dims) is quantized by
    :func:`quantize_rows`; ``acc`` = the int32 sums of levels times weights (exact); then in float32,
    ``(acc * x_scale[:, None]) * weight_scale`` (+ bias in float32), rounded once to ``x``'s dtype."""
    k = x.shape[-1]
    levels, x_scale = quantize_rows(x.reshape(-1, k))
    out = (int8_sums(levels, packed).float() * x_scale[:, None]) * weight_scale.float()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], out_features)


def fp8_quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float ``[m, k]`` -> (float8 e4m3 values as float32 ``[m, k]``, float32 scales ``[m]``), as compressed-tensors'
    forward quantizes a token: ``scale = max|row| / 448`` (a zero row: float32's eps), ``value = e4m3(clamp(x /
    scale, -448, 448))``, rounded to the nearest e4m3 value."""
    x = x.float()
    scale = x.abs().amax(dim=-1) / FP8_MAX
    scale = torch.where(scale == 0, torch.full_like(scale, torch.finfo(torch.float32).eps), scale)
    values = (x / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    return values, scale


@define_op
def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
               out_features: int) -> torch.Tensor:
    """``x @ W^T + bias`` for FP8 W8A8: ``weight`` the e4m3 levels as bfloat16 ``[n, k]`` (exact), ``weight_scale``
    float32 ``[n]`` (``W ~= level * weight_scale[:, None]``). Each row of ``x`` (any leading dims) is quantized by
    :func:`fp8_quantize_rows`; the float32 sums of level products (each exact), then ``(sums * x_scale[:, None]) *
    weight_scale`` (+ bias) in float32, rounded once to ``x``'s dtype."""
    values, x_scale = fp8_quantize_rows(x.reshape(-1, x.shape[-1]))
    return _fp8_scaled(values @ weight.float().t(), x_scale, weight_scale, bias, x, out_features)


def _fp8_scaled(sums: torch.Tensor, x_scale: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                x: torch.Tensor, out_features: int) -> torch.Tensor:
    out = (sums * x_scale[:, None]) * weight_scale
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], out_features)


def _levels_and_scales(layer: nn.Module, input_size: int, output_size: int, levels: torch.dtype) -> None:
    """The checkpoint's ``weight`` (``levels`` ``[out, in]``) and ``weight_scale`` (float32, one per output row) as
    the layer's parameters: a column split cuts the scales with the rows, a row split keeps them whole."""
    weight = nn.Parameter(torch.zeros(output_size, input_size, dtype=levels), requires_grad=False)
    weight.output_dim, weight.input_dim = 0, 1
    weight.weight_loader = partial(_load_levels, layer, levels)
    scale = nn.Parameter(torch.zeros(output_size, 1, dtype=torch.float32), requires_grad=False)
    scale.output_dim, scale.input_dim = 0, None
    layer.register_parameter("weight", weight)
    layer.register_parameter("weight_scale", scale)


def _load_levels(layer: nn.Module, dtype: torch.dtype, param: nn.Parameter, loaded: torch.Tensor,
                 shard_id: object = None) -> None:
    """A quantized layer's ``weight`` must arrive as its format's levels (int8, float8): a float one is a layer the
    checkpoint left unquantized."""
    if loaded.dtype != dtype:
        raise ValueError(f"is {loaded.dtype}, not the {dtype} of a quantized layer (a layer that "
                         f"quantization_config.ignore leaves unquantized is served only for lm_head)")
    layer.weight_loader(param, loaded) if shard_id is None else layer.weight_loader(param, loaded, shard_id)


class CompressedTensorsW8A8:
    """int8 weights ``[out, in]`` and per-output float32 scales; activations quantized per row at each call."""

    name = "compressed-tensors"

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, dtype: torch.dtype,
                       shard: ShardSpec = UNSPLIT) -> None:
        _levels_and_scales(layer, input_size, output_size, torch.int8)
        pack, linear = quant_kernel("w8a8_pack", self.name), quant_kernel("w8a8_linear", self.name)
        # the backend's pair or the reference's: one packs the layout the other reads
        layer.w8a8_ops = (pack, linear) if pack is not None and linear is not None else (w8a8_pack, w8a8_linear)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if "weight" not in layer._parameters:
            return  # already packed
        pack = layer.w8a8_ops[0]
        packed, scale = pack(layer.weight.data), layer.weight_scale.data.reshape(-1).float().contiguous()
        del layer.weight, layer.weight_scale
        layer.register_parameter("w8a8_weight", nn.Parameter(packed, requires_grad=False))
        layer.register_parameter("weight_scale", nn.Parameter(scale, requires_grad=False))

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return layer.w8a8_ops[1](x, layer.w8a8_weight, layer.weight_scale, bias, layer.output_size)

    def vocab_table(self, loaded: object, start: int, rows: int, dtype: torch.dtype, backend: object) -> None:
        """This format keeps no vocabulary tables (``QuantMethod.vocab_table``): embeddings stay dense."""
        return None


class CompressedTensorsFP8:
    """float8 e4m3 weights ``[out, in]`` with per-output float32 scales, held as bfloat16 (exact) after loading;
    activations quantized to float8 per row at each call (op ``fp8_linear``)."""

    name = "compressed-tensors"

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, dtype: torch.dtype,
                       shard: ShardSpec = UNSPLIT) -> None:
        _levels_and_scales(layer, input_size, output_size, torch.float8_e4m3fn)
        # a device kernel of the op, else the reference's steps with the products on the backend's 16-bit linear
        layer.fp8_kernel = quant_kernel("fp8_linear", self.name)
        layer.fp8_half = backend_op(current_context().backend, "half_linear") if has_context() else None

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if "weight" not in layer._parameters:
            return  # already converted
        levels, scale = layer.weight.data.to(torch.bfloat16), layer.weight_scale.data.reshape(-1).float().contiguous()
        del layer.weight, layer.weight_scale
        layer.register_parameter("fp8_weight", nn.Parameter(levels, requires_grad=False))
        layer.register_parameter("weight_scale", nn.Parameter(scale, requires_grad=False))

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        weight, scale = layer.fp8_weight, layer.weight_scale
        if layer.fp8_kernel is not None:
            return layer.fp8_kernel(x, weight, scale, bias, layer.output_size)
        values, x_scale = fp8_quantize_rows(x.reshape(-1, x.shape[-1]))
        if layer.fp8_half is not None:
            sums = half_weight_linear(values, weight, None, layer.fp8_half)
        else:  # bfloat16 tiles widened exactly for torch's float32 GEMM
            sums = tiled_linear(values, weight.shape[0], lambda start, stop: weight[start:stop].float(), None)
        return _fp8_scaled(sums, x_scale, scale, bias, x, layer.output_size)

    def vocab_table(self, loaded: object, start: int, rows: int, dtype: torch.dtype, backend: object) -> None:
        """This format keeps no vocabulary tables (``QuantMethod.vocab_table``): embeddings stay dense."""
        return None


# -- the checkpoint's quantization_config -----------------------------------------------------------------
SUPPORTED = ("int8 weights per channel, symmetric, static (strategy channel); int8 input activations per token, "
             "symmetric, dynamic (strategy token): llm-compressor's W8A8 / SmoothQuant + GPTQ int8 schemes; the same "
             "in float8 (type float, num_bits 8): its FP8_DYNAMIC scheme")


def _describe(args: dict) -> str:
    """A scheme's arguments in words, for errors."""
    parts = [f"{args.get('type', 'int')}{args.get('num_bits', '?')}", f"strategy {args.get('strategy')}",
             "symmetric" if args.get("symmetric", True) else "asymmetric",
             "dynamic" if args.get("dynamic") else "static"]
    if args.get("group_size") is not None:
        parts.append(f"group_size {args['group_size']}")
    if args.get("block_structure") is not None:
        parts.append(f"block_structure {args['block_structure']}")
    if args.get("actorder") not in (None, False):
        parts.append(f"actorder {args['actorder']}")
    return ", ".join(parts)


def _served(args: dict | None, strategy: str, dynamic: bool, kind: str) -> bool:
    return (args is not None and args.get("type", "int") == kind and args.get("num_bits") == 8
            and args.get("strategy") == strategy and args.get("symmetric", True) is True
            and bool(args.get("dynamic")) is dynamic and args.get("group_size") is None
            and args.get("block_structure") is None and args.get("actorder") in (None, False))


def _check_group(name: str, group: dict, top_format: str | None) -> str:
    """The group's kind ("int" or "float"); a ValueError naming it where pluginfer does not serve it."""
    targets = group.get("targets") or []
    where = f"quantization_config.config_groups.{name} (targets {', '.join(map(str, targets)) or 'none'})"
    weights, inputs = group.get("weights"), group.get("input_activations")
    kind = (weights or {}).get("type", "int")
    if kind not in FORMATS or not _served(weights, "channel", False, kind) or not _served(inputs, "token", True, kind):
        scheme = (f"weights {_describe(weights) if weights else 'none'}; "
                  f"input activations {_describe(inputs) if inputs else 'none (weight-only)'}")
        raise ValueError(f"{where}: compressed-tensors scheme not supported ({scheme}); supported: {SUPPORTED}")
    if group.get("output_activations"):
        raise ValueError(f"{where}: output_activations quantization is not supported "
                         f"({_describe(group['output_activations'])})")
    group_format = group.get("format") or top_format
    if group_format != FORMATS[kind]:
        raise ValueError(f"{where}: format {group_format!r} is not supported for {kind} weights (supported: "
                         f"{FORMATS[kind]})")
    if list(targets) != ["Linear"]:
        raise ValueError(f"{where}: targets must be ['Linear'] (every linear layer); per-layer targets are not "
                         f"supported")
    return kind


def check_config(config: dict) -> str:
    """The checkpoint's kind of weights ("int" or "float"); a ValueError naming the field (and the scheme and its
    layers) unless pluginfer serves this checkpoint."""
    method = config.get("quant_method")
    if method != "compressed-tensors":
        raise ValueError(f"quantization_config.quant_method: {method!r} is not a compressed-tensors checkpoint")
    status = config.get("quantization_status", "compressed")
    if status != "compressed":
        raise ValueError(f"quantization_config.quantization_status: {status!r} is not supported (the weights "
                         f"must be saved compressed, as llm-compressor's save_pretrained does)")
    groups = config.get("config_groups") or {}
    if not groups:
        raise ValueError("quantization_config.config_groups: empty; nothing says how the weights are quantized")
    kinds = {_check_group(name, group, config.get("format")) for name, group in groups.items()}
    if len(kinds) > 1:
        raise ValueError(f"quantization_config.config_groups: int8 and float8 groups in one checkpoint are not "
                         f"supported ({', '.join(groups)})")
    for field in ("kv_cache_scheme", "sparsity_config", "transform_config"):
        if config.get(field):
            raise ValueError(f"quantization_config.{field}: not supported ({config[field]})")
    others = [entry for entry in config.get("ignore") or [] if not _names_lm_head(entry)]
    if others:
        raise ValueError(f"quantization_config.ignore: unquantized layers {others} are not supported "
                         f"(only lm_head may stay unquantized)")
    return kinds.pop()


def _names_lm_head(entry: str) -> bool:
    if entry.startswith("re:"):
        return re.fullmatch(entry[3:], "lm_head") is not None
    return entry == "lm_head"


def build(quant_config: dict | None = None) -> CompressedTensorsW8A8 | CompressedTensorsFP8:
    if not quant_config:
        raise ValueError("quant method 'compressed-tensors' reads a compressed-tensors checkpoint's "
                         "quantization_config; this checkpoint has none (quantize it with llm-compressor, or use "
                         "--quant int8 to quantize the weights at load)")
    return CompressedTensorsW8A8() if check_config(quant_config) == "int" else CompressedTensorsFP8()
