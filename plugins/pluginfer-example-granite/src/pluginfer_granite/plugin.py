"""Registration only: what this plugin provides and where its factory lives."""

from pluginfer.core.hookspecs import PluginSpec, hookimpl


@hookimpl
def pluginfer_models() -> list[PluginSpec]:
    return [
        PluginSpec(kind="model", name="granite", architectures=("GraniteForCausalLM",),
                   factory="pluginfer_granite.model:build", api_versions=(2, 3),
                   description="IBM Granite 3.x (example out-of-tree plugin)"),
    ]
