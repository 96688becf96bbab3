"""The hooks a plugin implements, one per plugin kind.

A plugin is any object (usually a module) named by an entry point in the group ``pluginfer``. It
implements one or more of the hooks below with ``@hookimpl``; each hook returns a list of its kind's
spec (``pluginfer.core.specs``). Registration must be cheap: the ``factory`` module is imported only
when a config selects that name. docs/plugins.md is the reference of every kind.
"""

from __future__ import annotations

import pluggy

from pluginfer.core.specs import (
    KINDS,
    PLUGIN_API_VERSION,
    SPEC_CLASSES,
    BackendSpec,
    CheckpointFormatSpec,
    CollectiveSpec,
    EndpointSpec,
    ModelSpec,
    MultimodalProcessorSpec,
    PluginSpec,
    ProposerSpec,
    QuantSpec,
    ReasoningParserSpec,
    RequestProcessorSpec,
    ToolParserSpec,
)

PROJECT_NAME = "pluginfer"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def pluginfer_models() -> list[ModelSpec]:
    """Model pipelines: factory(hf_config: dict, ctx: BuildContext) -> ModelPipeline."""


@hookspec
def pluginfer_quant_methods() -> list[QuantSpec]:
    """Weight formats: factory(quant_config: dict | None) -> QuantMethod."""


@hookspec
def pluginfer_backends() -> list[BackendSpec]:
    """Devices: factory(config: EngineConfig, rank: RankInfo) -> DeviceBackend."""


@hookspec
def pluginfer_collectives() -> list[CollectiveSpec]:
    """Communication libraries: factory(config: EngineConfig, rank: RankInfo) -> Collective."""


@hookspec
def pluginfer_tool_parsers() -> list[ToolParserSpec]:
    """Tool-call parsers: factory() -> ToolCallParser (``pluginfer.core.serving``), one per request."""


@hookspec
def pluginfer_reasoning_parsers() -> list[ReasoningParserSpec]:
    """Reasoning parsers: factory() -> ReasoningParser (``pluginfer.core.serving``), one per choice."""


@hookspec
def pluginfer_endpoints() -> list[EndpointSpec]:
    """HTTP routes: factory(context: EndpointContext) -> None adds them with ``context.add_route``."""


@hookspec
def pluginfer_request_processors() -> list[RequestProcessorSpec]:
    """Per-request steps: factory(context: EndpointContext) -> RequestProcessor (``pluginfer.core.serving``)."""


@hookspec
def pluginfer_checkpoint_formats() -> list[CheckpointFormatSpec]:
    """Checkpoint formats: factory(path: Path) -> Checkpoint (``pluginfer.core.checkpoint``)."""


@hookspec
def pluginfer_proposers() -> list[ProposerSpec]:
    """Speculative proposers: factory(config: SpeculativeConfig, engine: EngineConfig) -> Proposer."""


@hookspec
def pluginfer_multimodal_processors() -> list[MultimodalProcessorSpec]:
    """Media preprocessing: factory(model_path: str, hf_config: dict, tokenizer) -> MultiModalProcessor
    (``pluginfer.core.protocols``), for the checkpoints of the spec's ``architectures``."""


HOOKS_BY_KIND = {
    "model": "pluginfer_models",
    "quant": "pluginfer_quant_methods",
    "backend": "pluginfer_backends",
    "collective": "pluginfer_collectives",
    "tool_parser": "pluginfer_tool_parsers",
    "reasoning_parser": "pluginfer_reasoning_parsers",
    "endpoint": "pluginfer_endpoints",
    "request_processor": "pluginfer_request_processors",
    "checkpoint_format": "pluginfer_checkpoint_formats",
    "proposer": "pluginfer_proposers",
    "multimodal_processor": "pluginfer_multimodal_processors",
}

__all__ = [
    "HOOKS_BY_KIND", "KINDS", "PLUGIN_API_VERSION", "PROJECT_NAME", "SPEC_CLASSES", "BackendSpec",
    "CheckpointFormatSpec", "CollectiveSpec", "EndpointSpec", "ModelSpec", "MultimodalProcessorSpec", "PluginSpec",
    "ProposerSpec", "QuantSpec", "ReasoningParserSpec", "RequestProcessorSpec", "ToolParserSpec", "hookimpl",
    "hookspec",
]
