"""pluginfer: an LLM inference and serving engine built as a small core and plugins."""

from pluginfer.core.hookspecs import PLUGIN_API_VERSION

_LAZY = {"LLM": "pluginfer.llm", "BeamSearchParams": "pluginfer.engine.beam_search",
         "LoRARequest": "pluginfer.engine.lora_request",
         "PoolingParams": "pluginfer.engine.pooling",
         "SamplingParams": "pluginfer.engine.sequence", "StructuredOutputsParams": "pluginfer.engine.structured"}


def _version() -> str:
    """The installed distribution's version: pyproject.toml's `version` is the one place it is written."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pluginfer")
    except PackageNotFoundError:  # a checkout on sys.path that was never installed
        return "0+unknown"


__version__ = _version()
__all__ = ["LLM", "BeamSearchParams", "LoRARequest", "PoolingParams", "SamplingParams", "StructuredOutputsParams",
           "PLUGIN_API_VERSION", "__version__"]


def __getattr__(name: str) -> type:
    # the engine loads on first use: `import pluginfer.core` stays contracts only
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pluginfer' has no attribute {name!r}")
