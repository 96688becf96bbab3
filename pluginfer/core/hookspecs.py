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
PLUGIN_API_VERSION = 3
"""Bump when a protocol changes incompatibly; a spec lists the versions it was written for."""

KINDS = ("model", "quant", "backend", "collective")

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@dataclass(frozen=True)
class PluginSpec:
    """One thing a plugin provides.

    ``factory``, ``check``, ``details`` and ``gguf_converter`` are ``"module:attr"`` strings, imported
    on first use. ``check`` returns ``None`` when the plugin can run here, else the reason it cannot
    (e.g. "no CUDA device"). ``details`` returns one line `pluginfer plugins` prints under the spec
    (e.g. which native kernels loaded). ``description`` is shown there too. ``architectures`` are HF
    ``config.json`` architecture names. ``priority``: among usable backends, ``backend: auto`` takes
    the highest (an accelerator over the cpu). A model spec reads GGUF files whose
    ``general.architecture`` is in ``gguf_architectures``: ``gguf_converter(checkpoint: GGUFCheckpoint)
    -> GGUFModel`` (``pluginfer.formats.gguf.checkpoint``) gives their HF config and tensor names.
    ``claims`` (quant specs): ``claims(quantization_config: dict) -> bool``, whether ``quant: auto``
    should pick this method for a checkpoint with that ``quantization_config`` (before the
    ``quant_method`` the config names; the highest priority wins). ``launchers`` (collective specs):
    ``parallel.collective: auto`` picks this collective for ranks started by these launchers
    (``inprocess``, ``spawn``, ``torchrun``, ``mpi``) before the backend's ``default_collective``.
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
    details: str | None = None
    gguf_architectures: tuple[str, ...] = ()
    gguf_converter: str | None = None
    claims: str | None = None
    launchers: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"PluginSpec.kind must be one of {KINDS}, got {self.kind!r}")
        for field in ("factory", "check", "details", "gguf_converter", "claims"):
            ref = getattr(self, field)
            if ref is not None and ":" not in ref:
                raise ValueError(f"PluginSpec.{field} must be 'module:attr', got {ref!r}")
        if bool(self.gguf_architectures) != (self.gguf_converter is not None):
            raise ValueError("PluginSpec.gguf_architectures and gguf_converter go together")

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
