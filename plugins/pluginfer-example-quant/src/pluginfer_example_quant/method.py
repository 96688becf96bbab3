"""The ``example-int8-rowwise`` quant method: weight-only int8, one float32 scale per output row (W8A16).

Two ways in: ``quant="example-int8-rowwise"`` on a floating-point checkpoint quantizes each linear weight
while it loads (factory called with no ``quantization_config``); a checkpoint whose ``quantization_config``
says ``{"quant_method": "example-int8-rowwise"}`` holds ``<layer>.qweight`` (int8 ``[out, in]``) and
``<layer>.scale`` (float32 ``[out]``), which ``quant: auto`` finds through the spec's ``claims``.

Tensor parallelism: a column-parallel rank holds whole rows and their scales. Quantized at load, a
row-parallel rank quantizes its own slice of each row (its scale is that slice's ``max|row| / 127``), so its
codes may differ from the one-rank layer's; a pre-quantized checkpoint keeps every rank on the saved codes.
"""

from __future__ import annotations

import torch
from torch import nn

from pluginfer.core.protocols import ShardSpec
from pluginfer.layers.context import quant_kernel
from pluginfer_example_quant.ops import example_int8_rowwise_matmul
from pluginfer_example_quant.plugin import NAME

OP = "example_int8_rowwise_matmul"
UNSPLIT = ShardSpec()  # one rank holds the whole weight


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 ``[out, in]``, float32 ``[out]``) with ``weight ~= qweight * scale[:, None]``, ``scale = max|row| / 127``."""
    weight = weight.float()
    scale = weight.abs().amax(dim=1) / 127
    divisor = torch.where(scale == 0, torch.ones_like(scale), scale)  # an all-zero row stays zero
    return torch.round(weight / divisor[:, None]).clamp_(-127, 127).to(torch.int8), scale


def dequantize(qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 weight the codes stand for."""
    return qweight.float() * scale.float()[:, None]


def _register(layer: nn.Module, name: str, tensor: torch.Tensor, input_dim: int | None) -> None:
    param = nn.Parameter(tensor, requires_grad=False)
    # the layer's loader slices by these under tensor parallelism
    param.output_dim, param.input_dim = 0, input_dim
    layer.register_parameter(name, param)


class Int8RowwiseLinear:
    """``QuantMethod``: ``prequantized`` False quantizes a float ``weight`` after loading; True loads codes."""

    name = NAME

    def __init__(self, prequantized: bool = False) -> None:
        self.prequantized = prequantized

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, dtype: torch.dtype,
                       shard: ShardSpec = UNSPLIT) -> None:
        if self.prequantized:
            _register(layer, "qweight", torch.zeros(output_size, input_size, dtype=torch.int8), 1)
            _register(layer, "scale", torch.zeros(output_size, dtype=torch.float32), None)
        else:
            _register(layer, "weight", torch.empty(output_size, input_size, dtype=dtype), 1)
        # The backend's kernel for this format's op, if it has one (here: the cpu kernel ops.py supplied).
        layer.example_int8_matmul = quant_kernel(OP, self.name)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if "weight" not in dict(layer.named_parameters(recurse=False)):
            return  # loaded as codes, or already quantized
        qweight, scale = quantize(layer.weight.data)
        # the float copy goes: only the int8 codes and the scales stay resident
        del layer.weight
        _register(layer, "qweight", qweight, 1)
        _register(layer, "scale", scale, None)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        kernel = getattr(layer, "example_int8_matmul", None) or example_int8_rowwise_matmul
        out = kernel(x, layer.qweight, layer.scale, bias)
        return out if out is not None else example_int8_rowwise_matmul(x, layer.qweight, layer.scale, bias)

    def vocab_table(self, loaded: object, start: int, rows: int, dtype: torch.dtype, backend: object) -> None:
        """Embeddings and the LM head stay dense in this format."""
        return None


def build(quant_config: dict | None = None) -> Int8RowwiseLinear:
    """No ``quantization_config``: quantize a float checkpoint at load; this method's own: load its codes."""
    if not quant_config:
        return Int8RowwiseLinear()
    if quant_config.get("quant_method") != NAME:
        raise ValueError(f"quant method {NAME!r} reads checkpoints it quantized or float ones; this checkpoint "
                         f"is quantized as {quant_config.get('quant_method', quant_config)!r}")
    return Int8RowwiseLinear(prequantized=True)
