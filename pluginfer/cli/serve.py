"""``pluginfer serve``: the OpenAI-compatible HTTP server over one model."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pluginfer.core.config import EngineConfig


def register(commands: argparse._SubParsersAction, add_engine_arguments: Callable) -> None:
    from pluginfer.core.options import add_arguments

    serve = commands.add_parser("serve", help="serve the OpenAI API (chat, completions, models, metrics) and a chat page at /")
    add_engine_arguments(serve)
    add_arguments(serve, sections=("server",))
    serve.set_defaults(run=run_serve)


def serve_config(args: argparse.Namespace) -> EngineConfig:
    """--config, then the engine and server flags on top; a parser, endpoint or request processor that no
    plugin provides (or whose factory does not import) fails here, before the model loads."""
    from pluginfer.cli import engine_config
    from pluginfer.core.registry import get_registry

    config = engine_config(args)
    server, registry = config.server, get_registry()
    if server.reasoning_parser:
        registry.load("reasoning_parser", server.reasoning_parser)
    if server.tool_call_parser:
        registry.load("tool_parser", server.tool_call_parser)
    for name in server.endpoints:
        registry.load("endpoint", name)
    for name in server.request_processors:
        registry.load("request_processor", name)
    return config


def run_serve(args: argparse.Namespace) -> int:
    from pluginfer.server.launch import run_server

    return run_server(serve_config(args))
