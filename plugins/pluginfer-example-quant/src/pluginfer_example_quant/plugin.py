"""Registration only: what this plugin provides and where its factory lives (no torch import here)."""

from pluginfer.core.hookspecs import QuantSpec, hookimpl

NAME = "example-int8-rowwise"


def claims(quantization_config: dict) -> bool:
    """``quant: auto`` picks this method for a checkpoint this method's quantizer saved."""
    return quantization_config.get("quant_method") == NAME


@hookimpl
def pluginfer_quant_methods() -> list[QuantSpec]:
    return [
        QuantSpec(name=NAME, factory="pluginfer_example_quant.method:build",
                  claims="pluginfer_example_quant.plugin:claims", api_versions=(5, 6),
                  description="int8 weights, one float scale per output row (example out-of-tree plugin)"),
    ]
