"""The core is contracts only: importing every ``pluginfer.core`` module loads no plugin, layer, engine,
format or server module."""

from __future__ import annotations

import subprocess
import sys

PLUGIN_PACKAGES = ("pluginfer.models", "pluginfer.quant", "pluginfer.backends", "pluginfer.collectives",
                   "pluginfer.demo", "pluginfer.layers", "pluginfer.engine", "pluginfer.formats", "pluginfer.text",
                   "pluginfer.server")
CODE = f"""
import importlib, pkgutil, sys
import pluginfer.core
for module in pkgutil.iter_modules(pluginfer.core.__path__):
    importlib.import_module("pluginfer.core." + module.name)
print(sorted(m for m in sys.modules if m.startswith({PLUGIN_PACKAGES!r})))
"""


def test_importing_every_core_module_loads_nothing_beyond_the_contracts() -> None:
    result = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "[]"
