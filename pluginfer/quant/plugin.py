"""Registers the built-in quant methods."""

from pluginfer.core.hookspecs import PluginSpec, hookimpl


@hookimpl
def pluginfer_quant_methods() -> list[PluginSpec]:
    return [
        PluginSpec(kind="quant", name="none", aliases=("unquantized", "fp"),
                   factory="pluginfer.quant.unquantized:build",
                   description="dense weights in the model dtype"),
        PluginSpec(kind="quant", name="int8", aliases=("w8a16",),
                   factory="pluginfer.quant.int8:build",
                   description="per-channel int8 weights quantized at load (W8A16)"),
        PluginSpec(kind="quant", name="q8_0",
                   factory="pluginfer.quant.ggml_q8_0:build",
                   description="GGUF Q8_0 blocks (32 int8 + fp16 scale) quantized at load"),
    ]
