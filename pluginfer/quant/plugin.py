"""Registers the built-in quant methods."""

from pluginfer.core.hookspecs import PluginSpec, hookimpl


@hookimpl
def pluginfer_quant_methods() -> list[PluginSpec]:
    return [
        PluginSpec(kind="quant", name="none", aliases=("unquantized", "fp"),
                   factory="pluginfer.quant.unquantized:build",
                   description="dense weights in the model dtype"),
    ]
