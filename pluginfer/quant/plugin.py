"""Registers the built-in quant methods."""

from pluginfer.core.hookspecs import QuantSpec, hookimpl

# In-situ block formats of llama.cpp: quantized from a floating-point checkpoint while it loads.
_GGML_INSITU = {
    "q8_0": "32 int8 + fp16 scale",
    "q4_0": "32 4-bit + fp16 scale",
    "q4_1": "32 4-bit + fp16 scale and min",
    "q5_0": "32 5-bit + fp16 scale",
    "q5_1": "32 5-bit + fp16 scale and min",
    "q4_k": "256-weight super-blocks of 4-bit, 6-bit sub-block scales",
    "q6_k": "256-weight super-blocks of 6-bit, 8-bit sub-block scales",
}


@hookimpl
def pluginfer_quant_methods() -> list[QuantSpec]:
    specs = [
        QuantSpec(name="none", aliases=("unquantized", "fp"),
                  factory="pluginfer.quant.unquantized:build", claims="pluginfer.quant.unquantized:is_unquantized",
                  description="dense weights in the model dtype"),
        QuantSpec(name="int8", aliases=("w8a16",),
                  factory="pluginfer.quant.int8:build",
                  description="per-channel int8 weights quantized at load (W8A16)"),
        QuantSpec(name="int4", aliases=("w4a16",),
                  factory="pluginfer.quant.int4:build",
                  description="group-wise int4 weights quantized at load (W4A16)"),
        QuantSpec(name="gguf",
                  factory="pluginfer.quant.gguf:build",
                  description="tensors of a .gguf file, kept in their GGML block types"),
        QuantSpec(name="gptq",
                  factory="pluginfer.quant.gptq:build",
                  description="GPTQ checkpoints (4/8-bit, groups, act-order, sym/asym)"),
        QuantSpec(name="awq",
                  factory="pluginfer.quant.awq:build",
                  description="AWQ GEMM checkpoints (4-bit, zero point)"),
        QuantSpec(name="compressed-tensors", aliases=("w8a8",),
                  factory="pluginfer.quant.compressed_tensors:build",
                  description="int8 weights and per-token int8 activations (W8A8) from llm-compressor"),
        QuantSpec(name="fp8",
                  factory="pluginfer.quant.fp8:build",
                  description="block-wise FP8 checkpoints (DeepSeek-V3, Qwen3-FP8), dequantized at load"),
        QuantSpec(name="marlin",
                  factory="pluginfer.quant.marlin:build", claims="pluginfer.quant.marlin_layout:is_marlin_checkpoint",
                  description="4-bit GPTQ/AWQ repacked into Marlin tiles (Triton kernel; generic on CPU)"),
    ]
    specs += [QuantSpec(name=name, factory=f"pluginfer.quant.ggml_insitu:build_{name}",
                        description=f"GGUF {name.upper()} blocks ({layout}) quantized at load")
              for name, layout in _GGML_INSITU.items()]
    return specs
