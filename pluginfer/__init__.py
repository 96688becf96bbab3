"""pluginfer: an LLM inference and serving engine built as a small core and plugins."""

from pluginfer.core.hookspecs import PLUGIN_API_VERSION
from pluginfer.core.sequence import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "PLUGIN_API_VERSION", "__version__"]


def __getattr__(name: str):  # noqa: ANN202 - LLM pulls in the engine; keep `import pluginfer` cheap
    if name == "LLM":
        from pluginfer.llm import LLM

        return LLM
    raise AttributeError(f"module 'pluginfer' has no attribute {name!r}")
