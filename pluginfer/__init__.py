"""pluginfer: an LLM inference and serving engine built as a small core and plugins."""

from pluginfer.core.hookspecs import PLUGIN_API_VERSION
from pluginfer.core.pooling import PoolingParams
from pluginfer.core.sequence import SamplingParams
from pluginfer.core.structured import StructuredOutputsParams


def _version() -> str:
    """The installed distribution's version: pyproject.toml's `version` is the one place it is written."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pluginfer")
    except PackageNotFoundError:  # a checkout on sys.path that was never installed
        return "0+unknown"


__version__ = _version()
__all__ = ["LLM", "PoolingParams", "SamplingParams", "StructuredOutputsParams", "PLUGIN_API_VERSION", "__version__"]


def __getattr__(name: str) -> type:  # LLM pulls in the engine; keep `import pluginfer` cheap
    if name == "LLM":
        from pluginfer.llm import LLM

        return LLM
    raise AttributeError(f"module 'pluginfer' has no attribute {name!r}")
