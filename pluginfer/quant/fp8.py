"""The ``fp8`` quant method: block-wise FP8 checkpoints (``quant_method: fp8``, ``weight_block_size``), as
DeepSeek-V3/R1 and Qwen3's ``-FP8`` models ship.

Each quantized weight ``X.weight`` is float8 e4m3 ``[out, in]`` with ``X.weight_scale_inv`` float32, one per block
of ``weight_block_size`` (``[ceil(out / bn), ceil(in / bk)]``): ``W = level * scale`` blockwise. The method
combines each pair as the checkpoint streams in (``checkpoint_tensors``), so every layer, mixture-of-experts
experts and latent attention included, receives a dense weight, and serves it as the ``none`` method does (its
layouts and kernels), as transformers does on a CPU (``dequantize``) and vLLM where a device has no FP8 GEMM: the
activations stay in the model's dtype (``activation_scheme: dynamic``'s per-group quantization of the activations
is not done; it would only move the logits away from the dequantized model's).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from pluginfer.quant.unquantized import UnquantizedLinear

_SCALE = "_scale_inv"  # X.weight_scale_inv scales X.weight


class BlockFP8Linear(UnquantizedLinear):
    """Dense weights of the model's dtype, made from the checkpoint's float8 blocks and their scales."""

    name = "fp8"

    def __init__(self, block: tuple[int, int]) -> None:
        self.block = block

    def checkpoint_tensors(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Each float8 weight with its block scales as one float32 weight (``QuantMethod.checkpoint_tensors``);
        the other tensors as they come. A level tensor without its scales, or scales without their levels, is an
        error naming it once the checkpoint has been read."""
        levels: dict[str, torch.Tensor] = {}
        scales: dict[str, torch.Tensor] = {}
        dense: dict[str, torch.dtype] = {}  # weights that came as floats, should their scales follow
        for name, tensor in tensors:
            if name.endswith(_SCALE):
                weight = name.removesuffix(_SCALE)
                if weight in dense:
                    raise ValueError(f"{name}: {weight} is {dense[weight]}, not the float8_e4m3fn levels it scales")
                if weight in levels:
                    yield weight, self.dequantize(weight, levels.pop(weight), tensor)
                else:
                    scales[weight] = tensor
            elif tensor.dtype == torch.float8_e4m3fn:
                if name in scales:
                    yield name, self.dequantize(name, tensor, scales.pop(name))
                else:
                    levels[name] = tensor
            else:
                if name in scales:
                    raise ValueError(f"{name}{_SCALE}: {name} is {tensor.dtype}, not the float8_e4m3fn levels it "
                                     f"scales")
                if name.endswith(".weight"):
                    dense[name] = tensor.dtype
                yield name, tensor
        if levels or scales:
            lonely = [f"{name} (no {name}{_SCALE})" for name in levels] + \
                [f"{name}{_SCALE} (no {name})" for name in scales]
            raise KeyError(f"fp8 checkpoint: {', '.join(sorted(lonely)[:4])}" + (" ..." if len(lonely) > 4 else ""))

    def dequantize(self, name: str, levels: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        rows, cols = levels.shape[-2:]
        bn, bk = self.block
        grid = (-(-rows // bn), -(-cols // bk))
        if tuple(scale.shape[-2:]) != grid or scale.shape[:-2] != levels.shape[:-2]:
            raise ValueError(f"{name}{_SCALE}: shape {tuple(scale.shape)}, where {name} {tuple(levels.shape)} in "
                             f"blocks of {list(self.block)} (quantization_config.weight_block_size) needs {grid}")
        expanded = scale.float().repeat_interleave(bn, dim=-2)[..., :rows, :].repeat_interleave(bk, dim=-1)
        return levels.float() * expanded[..., :cols]


def build(quant_config: dict | None = None) -> BlockFP8Linear:
    if not quant_config:
        raise ValueError("quant method 'fp8' reads an FP8 checkpoint's quantization_config (quant_method: fp8, "
                         "weight_block_size); this checkpoint has none")
    block = quant_config.get("weight_block_size")
    if not (isinstance(block, list | tuple) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"quantization_config.weight_block_size: {block!r}: only block-wise FP8 ([rows, inputs] "
                         f"of a block) is supported, not per-tensor scales")
    for field, allowed in (("fmt", ("e4m3", None)), ("activation_scheme", ("dynamic", None))):
        if quant_config.get(field) not in allowed:
            raise ValueError(f"quantization_config.{field}: {quant_config[field]!r} is not supported (supported: "
                             f"{allowed[0]})")
    unknown = sorted(set(quant_config) - {"quant_method", "weight_block_size", "fmt", "activation_scheme"})
    if unknown:
        raise ValueError(f"quantization_config: {', '.join(unknown)} not supported by the fp8 method")
    return BlockFP8Linear((block[0], block[1]))
