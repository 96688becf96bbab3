"""The ``compressed-tensors`` quant method: W8A8 int8 checkpoints as llm-compressor writes them.

Served: ``int-quantized``, int8 weights per output channel, symmetric, with int8 activations per token,
symmetric and dynamic; any other scheme is an error naming it and the config group it applies to. Activations
are quantized as compressed-tensors' own forward does (``scale = max|x| / 127.5``, half to even, ``[-128, 127]``;
vLLM's kernels differ by a level at most). The matmul is two kernel-table ops, ``w8a8_pack`` (at load) and
``w8a8_linear``, whose references below are exact on every device.
"""

from __future__ import annotations

import re
from functools import partial

import torch
from torch import nn

from pluginfer.core.kernels import define_op
from pluginfer.core.protocols import ShardSpec
from pluginfer.layers.context import quant_kernel
from pluginfer.quant.sharding import UNSPLIT

FORMATS = ("int-quantized",)
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


def _load_int8(layer: nn.Module, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
    """A quantized layer's ``weight`` must arrive as int8: a float one is a layer the checkpoint left unquantized."""
    if loaded.dtype != torch.int8:
        raise ValueError(f"is {loaded.dtype}, not the int8 of an int-quantized layer (a layer that "
                         f"quantization_config.ignore leaves unquantized is served only for lm_head)")
    layer.weight_loader(param, loaded) if shard_id is None else layer.weight_loader(param, loaded, shard_id)


class CompressedTensorsW8A8:
    """int8 weights ``[out, in]`` and per-output float32 scales; activations quantized per row at each call."""

    name = "compressed-tensors"

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, dtype: torch.dtype,
                       shard: ShardSpec = UNSPLIT) -> None:
        # Per-output scales: a column split cuts them with the rows, a row split keeps them whole.
        weight = nn.Parameter(torch.zeros(output_size, input_size, dtype=torch.int8), requires_grad=False)
        weight.output_dim, weight.input_dim = 0, 1
        weight.weight_loader = partial(_load_int8, layer)
        scale = nn.Parameter(torch.zeros(output_size, 1, dtype=torch.float32), requires_grad=False)
        scale.output_dim, scale.input_dim = 0, None
        layer.register_parameter("weight", weight)
        layer.register_parameter("weight_scale", scale)
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


# -- the checkpoint's quantization_config -----------------------------------------------------------------
SUPPORTED = ("int8 weights per channel, symmetric, static (strategy channel); int8 input activations per token, "
             "symmetric, dynamic (strategy token): llm-compressor's W8A8 / SmoothQuant + GPTQ int8 schemes")


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


def _served(args: dict | None, strategy: str, dynamic: bool) -> bool:
    return (args is not None and args.get("type", "int") == "int" and args.get("num_bits") == 8
            and args.get("strategy") == strategy and args.get("symmetric", True) is True
            and bool(args.get("dynamic")) is dynamic and args.get("group_size") is None
            and args.get("block_structure") is None and args.get("actorder") in (None, False))


def _check_group(name: str, group: dict, top_format: str | None) -> None:
    targets = group.get("targets") or []
    where = f"quantization_config.config_groups.{name} (targets {', '.join(map(str, targets)) or 'none'})"
    weights, inputs = group.get("weights"), group.get("input_activations")
    if not _served(weights, "channel", False) or not _served(inputs, "token", True):
        scheme = (f"weights {_describe(weights) if weights else 'none'}; "
                  f"input activations {_describe(inputs) if inputs else 'none (weight-only)'}")
        raise ValueError(f"{where}: compressed-tensors scheme not supported ({scheme}); supported: {SUPPORTED}")
    if group.get("output_activations"):
        raise ValueError(f"{where}: output_activations quantization is not supported "
                         f"({_describe(group['output_activations'])})")
    group_format = group.get("format") or top_format
    if group_format not in FORMATS:
        raise ValueError(f"{where}: format {group_format!r} is not supported (supported: {', '.join(FORMATS)})")
    if list(targets) != ["Linear"]:
        raise ValueError(f"{where}: targets must be ['Linear'] (every linear layer); per-layer targets are not "
                         f"supported")


def check_config(config: dict) -> None:
    """ValueError naming the field (and the scheme and its layers) unless pluginfer serves this checkpoint."""
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
    for name, group in groups.items():
        _check_group(name, group, config.get("format"))
    for field in ("kv_cache_scheme", "sparsity_config", "transform_config"):
        if config.get(field):
            raise ValueError(f"quantization_config.{field}: not supported ({config[field]})")
    others = [entry for entry in config.get("ignore") or [] if not _names_lm_head(entry)]
    if others:
        raise ValueError(f"quantization_config.ignore: unquantized layers {others} are not supported "
                         f"(only lm_head may stay unquantized)")


def _names_lm_head(entry: str) -> bool:
    if entry.startswith("re:"):
        return re.fullmatch(entry[3:], "lm_head") is not None
    return entry == "lm_head"


def build(quant_config: dict | None = None) -> CompressedTensorsW8A8:
    if not quant_config:
        raise ValueError("quant method 'compressed-tensors' reads a compressed-tensors checkpoint's "
                         "quantization_config; this checkpoint has none (quantize it with llm-compressor, or use "
                         "--quant int8 to quantize the weights at load)")
    check_config(quant_config)
    return CompressedTensorsW8A8()
