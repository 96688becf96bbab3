"""Registers the built-in collectives."""

from pluginfer.core.hookspecs import PluginSpec, hookimpl


@hookimpl
def pluginfer_collectives() -> list[PluginSpec]:
    return [
        PluginSpec(kind="collective", name="single", aliases=("none",),
                   factory="pluginfer.collectives.single:build",
                   description="one rank, no communication"),
    ]
