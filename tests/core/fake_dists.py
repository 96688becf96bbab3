"""Real (tiny) installed distributions on disk, found by importlib.metadata through sys.path."""

from __future__ import annotations

import importlib
import sys
import textwrap
from pathlib import Path


def make_dist(
    site: Path,
    name: str,
    version: str = "1.0",
    modules: dict[str, str] | None = None,
    entry_points: dict[str, str] | None = None,
) -> Path:
    """Write ``modules`` (dotted name -> source) and ``<name>-<version>.dist-info`` into ``site``.

    ``entry_points`` maps entry-point names in the ``pluginfer`` group to ``module[:attr]``.
    Returns the dist-info folder. ``site`` must already be on sys.path.
    """
    for module, source in (modules or {}).items():
        *packages, leaf = module.split(".")
        folder = site.joinpath(*packages)
        folder.mkdir(parents=True, exist_ok=True)
        for depth in range(1, len(packages) + 1):
            init = site.joinpath(*packages[:depth], "__init__.py")
            if not init.exists():
                init.write_text("")
        (folder / f"{leaf}.py").write_text(textwrap.dedent(source))
    dist_info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    lines = ["[pluginfer]", *(f"{ep} = {target}" for ep, target in (entry_points or {}).items())]
    (dist_info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    importlib.invalidate_caches()
    return dist_info


def forget_modules(site: Path) -> None:
    """Drop from sys.modules every module imported from ``site``, so later tests import afresh."""
    root = str(site.resolve())
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None) or ""
        if path and str(Path(path).resolve()).startswith(root):
            del sys.modules[name]
    importlib.invalidate_caches()


def plugin_source(specs: str, hook: str = "pluginfer_models") -> str:
    """Source of a plugin module whose ``hook`` returns ``specs`` (a Python list expression)."""
    return (
        "from pluginfer.core.hookspecs import (PLUGIN_API_VERSION, BackendSpec, CheckpointFormatSpec, CollectiveSpec,\n"
        "    EndpointSpec, ModelSpec, QuantSpec, ReasoningParserSpec, RequestProcessorSpec, ToolParserSpec, hookimpl)\n\n\n"
        f"@hookimpl\ndef {hook}():\n    return {specs}\n"
    )
