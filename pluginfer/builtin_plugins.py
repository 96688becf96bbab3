"""The plugins pluginfer ships, as ``pyproject.toml`` declares them in the ``pluginfer`` entry-point group.

The registry loads these from here when no entry point names them: pluginfer run from a source
checkout (``PYTHONPATH=.``) that was never installed. Installed, the entry points load them, once.
"""

DEFAULT_PLUGINS = {
    "builtin-models": "pluginfer.models.plugin",
    "builtin-quant": "pluginfer.quant.plugin",
    "builtin-backends": "pluginfer.backends.plugin",
    "builtin-collectives": "pluginfer.collectives.plugin",
    "builtin-parsers": "pluginfer.server.plugin",
    "builtin-formats": "pluginfer.formats.plugin",
    "builtin-proposers": "pluginfer.speculative.plugin",
}
