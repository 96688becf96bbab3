"""The hooks a plugin implements, and the spec each registration hands the core.

A plugin is any object (usually a module) named by an entry point in the group
``pluginfer``. It implements one or more of the hooks below with ``@hookimpl``; each hook
returns a list of ``PluginSpec``. Registration must be cheap: the ``factory`` module is
imported only when a config selects that name.
"""

from __future__ import annotations

from dataclasses import dataclass

import pluggy

PROJECT_NAME = "pluginfer"
PLUGIN_API_VERSION = 2
"""Bump when a protocol changes incompatibly; a spec lists the versions it was written for."""

KINDS = ("model", "quant", "backend", "collective")

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@dataclass(frozen=True)
class PluginSpec:
    """One thing a plugin provides.

    ``factory`` and ``check`` are ``"module:attr"`` strings, imported on first use.
    ``check`` returns ``None`` when the plugin can run here, else the reason it cannot
    (e.g. "no CUDA device"). ``architectures`` are HF ``config.json`` architecture names.
    ``priority``: among usable backends, ``backend: auto`` takes the highest (an accelerator over the cpu).
    """

    kind: str
    name: str
    factory: str
    aliases: tuple[str, ...] = ()
    architectures: tuple[str, ...] = ()
    api_versions: tuple[int, ...] = (PLUGIN_API_VERSION,)
    overrides: bool = False
    check: str | None = None
    description: str = ""
    priority: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"PluginSpec.kind must be one of {KINDS}, got {self.kind!r}")
        if ":" not in self.factory:
            raise ValueError(f"PluginSpec.factory must be 'module:attr', got {self.factory!r}")

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases, *self.architectures)


@hookspec
def pluginfer_models() -> list[PluginSpec]:
    """Model pipelines (kind "model"): factory(hf_config: dict, ctx: BuildContext) -> ModelPipeline."""


@hookspec
def pluginfer_quant_methods() -> list[PluginSpec]:
    """Weight formats (kind "quant"): factory(quant_config: dict | None) -> QuantMethod."""


@hookspec
def pluginfer_backends() -> list[PluginSpec]:
    """Devices (kind "backend"): factory(config: EngineConfig, rank: RankInfo) -> DeviceBackend."""


@hookspec
def pluginfer_collectives() -> list[PluginSpec]:
    """Communication libraries (kind "collective"): factory(config: EngineConfig, rank: RankInfo) -> Collective."""


HOOKS_BY_KIND = {
    "model": "pluginfer_models",
    "quant": "pluginfer_quant_methods",
    "backend": "pluginfer_backends",
    "collective": "pluginfer_collectives",
}
