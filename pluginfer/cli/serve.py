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
    """--config, then the engine and server flags on top; an unknown reasoning parser fails here."""
    from pluginfer.cli import engine_config
    from pluginfer.server.reasoning import get_reasoning_parser
    from pluginfer.server.tool_parsers import get_tool_parser

    config = engine_config(args)
    if config.server.reasoning_parser:
        get_reasoning_parser(config.server.reasoning_parser)  # before the model loads, not after
    if config.server.tool_call_parser:
        get_tool_parser(config.server.tool_call_parser)
    return config


def run_serve(args: argparse.Namespace) -> int:
    from pluginfer.server.launch import run_server

    return run_server(serve_config(args))
