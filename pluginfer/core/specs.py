"""The spec a registration hands the core: one class per plugin kind, each with only its own fields.

A spec is cheap data: names, and ``"module:attr"`` references the core imports only when a config
selects the name. The common fields live on ``PluginSpec``; a hook returns instances of its kind's
subclass (``ModelSpec`` from ``pluginfer_models``, ``QuantSpec`` from ``pluginfer_quant_methods``, ...).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

PLUGIN_API_VERSION = 6
"""Bump when a protocol or a spec changes incompatibly; a spec lists the versions it was written for."""


@dataclass(frozen=True)
class PluginSpec:
    """What every spec says. Use a kind's subclass; this base is not a spec of its own.

    ``factory``, ``check`` and ``details`` are ``"module:attr"`` strings, imported on first use.
    ``check()`` returns ``None`` when the plugin can run here, else the reason it cannot (e.g. "no
    CUDA device"). ``details()`` returns one line `pluginfer plugins` prints under the spec.
    ``description`` is shown on the spec's line. ``overrides``: this spec wins a name another plugin
    also claims. ``priority``: where several specs qualify (``backend: auto``, a ``claims``), the
    highest wins.
    """

    kind: ClassVar[str] = ""
    name: str
    factory: str
    aliases: tuple[str, ...] = ()
    api_versions: tuple[int, ...] = (PLUGIN_API_VERSION,)
    overrides: bool = False
    check: str | None = None
    description: str = ""
    details: str | None = None
    priority: int = 0

    def __new__(cls, *args: Any, **kwargs: Any) -> PluginSpec:
        if cls is PluginSpec:
            raise TypeError("PluginSpec is the base of the spec classes since plugin API 4: use ModelSpec, "
                            "QuantSpec, BackendSpec, CollectiveSpec, ... (docs/plugins.md, 'Plugin API version 4')")
        return super().__new__(cls)

    def __post_init__(self) -> None:
        for item in fields(self):
            value = getattr(self, item.name)
            if item.name in _REFERENCES and value is not None and ":" not in value:
                raise ValueError(f"{type(self).__name__}.{item.name} must be 'module:attr', got {value!r}")
        if not self.name:
            raise ValueError(f"{type(self).__name__}.name must not be empty")

    @property
    def exact_names(self) -> tuple[str, ...]:
        """Names matched with their case (a model's HF architectures); name and aliases ignore case."""
        return ()

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases, *self.exact_names)


_REFERENCES = frozenset({"factory", "check", "details", "claims"})


@dataclass(frozen=True)
class ModelSpec(PluginSpec):
    """A model pipeline. ``architectures``: HF ``config.json`` architecture names (exact case).

    ``converters``: for each checkpoint format, the format's own architecture names this plugin reads and
    the ``"module:attr"`` function that reads them, e.g. ``{"gguf": {"gemma3": "my_plugin.gguf:convert"}}``.
    What that function is given and returns is the format plugin's contract (docs/plugins.md).
    """

    kind: ClassVar[str] = "model"
    architectures: tuple[str, ...] = ()
    converters: Mapping[str, Mapping[str, str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__post_init__()
        for format_name, table in self.converters.items():
            for architecture, ref in table.items():
                if not isinstance(ref, str) or ":" not in ref:
                    raise ValueError(f"ModelSpec.converters[{format_name!r}][{architecture!r}] must be "
                                     f"'module:attr', got {ref!r}")

    def __hash__(self) -> int:  # converters is a dict; a spec is identified by its kind and name
        return hash((self.kind, self.name))

    @property
    def exact_names(self) -> tuple[str, ...]:
        return self.architectures


@dataclass(frozen=True)
class QuantSpec(PluginSpec):
    """A weight format. ``claims(quantization_config: dict) -> bool``: whether ``quant: auto`` picks this
    method for a checkpoint with that ``quantization_config`` (before the ``quant_method`` it names)."""

    kind: ClassVar[str] = "quant"
    claims: str | None = None


@dataclass(frozen=True)
class BackendSpec(PluginSpec):
    """A device. ``backend: auto`` takes the usable backend of the highest ``priority``."""

    kind: ClassVar[str] = "backend"


@dataclass(frozen=True)
class CollectiveSpec(PluginSpec):
    """A communication library. ``parallel.collective: auto`` picks it for ranks started by ``launchers``
    (``inprocess``, ``spawn``, ``torchrun``, ``mpi``) before the backend's ``default_collective``."""

    kind: ClassVar[str] = "collective"
    launchers: tuple[str, ...] = ()


@dataclass(frozen=True)
class ToolParserSpec(PluginSpec):
    """A tool-call parser, chosen with ``--tool-call-parser`` (``server.tool_call_parser``)."""

    kind: ClassVar[str] = "tool_parser"


@dataclass(frozen=True)
class ReasoningParserSpec(PluginSpec):
    """A reasoning parser, chosen with ``--reasoning-parser`` (``server.reasoning_parser``)."""

    kind: ClassVar[str] = "reasoning_parser"


@dataclass(frozen=True)
class EndpointSpec(PluginSpec):
    """HTTP routes, added to the server when ``server.endpoints`` names this spec."""

    kind: ClassVar[str] = "endpoint"


@dataclass(frozen=True)
class RequestProcessorSpec(PluginSpec):
    """A per-request pre/post step, run when ``server.request_processors`` names this spec."""

    kind: ClassVar[str] = "request_processor"


@dataclass(frozen=True)
class CheckpointFormatSpec(PluginSpec):
    """A checkpoint format. ``claims(path: pathlib.Path) -> bool``: whether this format reads ``path``
    (a directory or a file); among the formats that claim a path the highest ``priority`` opens it."""

    kind: ClassVar[str] = "checkpoint_format"
    claims: str = ""

    def __post_init__(self) -> None:
        super().__post_init__()
        if ":" not in self.claims:
            raise ValueError(f"CheckpointFormatSpec.claims must be 'module:attr', got {self.claims!r}")


@dataclass(frozen=True)
class ProposerSpec(PluginSpec):
    """A speculative-decoding proposer, chosen by ``speculative_config.method``."""

    kind: ClassVar[str] = "proposer"


@dataclass(frozen=True)
class MultimodalProcessorSpec(PluginSpec):
    """A model's preprocessing of media (images): ``factory(model_path, hf_config, tokenizer)`` makes the
    ``MultiModalProcessor`` for checkpoints whose HF ``architectures`` (exact case) this spec lists.
    A checkpoint no such spec lists takes text only."""

    kind: ClassVar[str] = "multimodal_processor"
    architectures: tuple[str, ...] = ()

    @property
    def exact_names(self) -> tuple[str, ...]:
        return self.architectures


SPEC_CLASSES: dict[str, type[PluginSpec]] = {
    cls.kind: cls for cls in (ModelSpec, QuantSpec, BackendSpec, CollectiveSpec, ToolParserSpec,
                              ReasoningParserSpec, EndpointSpec, RequestProcessorSpec, CheckpointFormatSpec,
                              ProposerSpec, MultimodalProcessorSpec)
}
KINDS = tuple(SPEC_CLASSES)
CLAIMING_KINDS = ("quant", "checkpoint_format")
"""Kinds whose spec has ``claims``: ``Registry.claiming`` asks them which one takes an argument."""
