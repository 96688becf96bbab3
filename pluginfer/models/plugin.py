"""Registers the built-in model pipelines (cheap: the model modules load only when selected)."""

from pluginfer.core.hookspecs import PluginSpec, hookimpl


@hookimpl
def pluginfer_models() -> list[PluginSpec]:
    return [
        PluginSpec(kind="model", name="llama", aliases=("llama3", "mistral", "yi"),
                   architectures=("LlamaForCausalLM", "MistralForCausalLM"),
                   factory="pluginfer.models.llama:build",
                   description="Llama 1-3, Mistral, Yi"),
    ]
