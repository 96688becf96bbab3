"""Registration only: what this plugin provides and where its factory lives."""

from pluginfer.core.hookspecs import ModelSpec, hookimpl


@hookimpl
def pluginfer_models() -> list[ModelSpec]:
    return [
        ModelSpec(name="granite", architectures=("GraniteForCausalLM",),
                  factory="pluginfer_granite.model:build", api_versions=(5, 6),
                  description="IBM Granite 3.x (example out-of-tree plugin)"),
    ]
