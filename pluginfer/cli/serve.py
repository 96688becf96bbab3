"""``pluginfer serve``: the OpenAI-compatible HTTP server over one model."""

from __future__ import annotations

import argparse
import errno
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pluginfer.core.config import EngineConfig


def register(commands: argparse._SubParsersAction, add_engine_arguments: Callable) -> None:
    from pluginfer.cli.options import add_arguments

    serve = commands.add_parser(
        "serve", help="serve the OpenAI API (chat, completions, models, metrics) and a chat page at /",
        usage="%(prog)s --model MODEL [--config FILE] [options]",
        description="Serve --model (a Hugging Face checkpoint directory, a hub id, a .gguf file, or demo) over the "
                    "OpenAI API. Each flag sets a field of the deployment config and overrides --config "
                    "(`pluginfer config-schema` lists them).")
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


def check_address(host: str, port: int) -> None:
    """A ValueError saying so when ``host:port`` cannot be listened on (in use, say), before the model loads."""
    if port == 0:
        return
    shown = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ValueError(f"cannot listen on {shown}: {exc.strerror}") from None
    for family, kind, protocol, _, address in addresses:
        with socket.socket(family, kind, protocol) as probe:
            # As asyncio's server sets it: a port left in TIME_WAIT by an earlier server is free.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:  # asyncio's too: "::" does not take the IPv4 port as well
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise ValueError(f"{shown} is in use") from None
                raise ValueError(f"cannot listen on {shown}: {exc.strerror}") from None


def run_serve(args: argparse.Namespace) -> int:
    from pluginfer.server.launch import run_server

    config = serve_config(args)
    check_address(config.server.host, config.server.port)
    return run_server(config)
