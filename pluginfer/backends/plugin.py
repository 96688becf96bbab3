"""Registers the built-in device backends."""

from pluginfer.core.hookspecs import PluginSpec, hookimpl


@hookimpl
def pluginfer_backends() -> list[PluginSpec]:
    return [
        PluginSpec(kind="backend", name="cpu", factory="pluginfer.backends.cpu:build",
                   description="torch on the host CPU", details="pluginfer.backends.native:report"),
    ]
