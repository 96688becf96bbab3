"""``pluginfer serve``: the OpenAI-compatible HTTP server over one model."""

from __future__ import annotations

import argparse
from collections.abc import Callable

# flag -> dotted ServerConfig field; like the engine flags they override --config.
SERVER_FLAGS: dict[str, tuple[str, type, str]] = {
    "--host": ("server.host", str, "address to listen on (default 127.0.0.1)"),
    "--port": ("server.port", int, "port (default 8000; 0: a free one)"),
    "--served-model-name": ("server.served_model_name", str, "model name clients use (default --model)"),
    "--max-waiting": ("server.max_waiting", int, "queued requests before answering 429"),
    "--max-request-bytes": ("server.max_request_bytes", int, "largest request body (413 beyond)"),
    "--max-logprobs": ("server.max_logprobs", int, "most top logprobs a request may ask for"),
    "--reasoning-parser": ("server.reasoning_parser", str, "deepseek_r1 or qwen3: <think> text to reasoning_content"),
}


def register(commands: argparse._SubParsersAction, add_engine_arguments: Callable) -> None:
    serve = commands.add_parser("serve", help="serve the OpenAI API (chat, completions, models, metrics)")
    add_engine_arguments(serve)
    for flag, (dest, kind, help_text) in SERVER_FLAGS.items():
        serve.add_argument(flag, dest=dest, type=kind, default=None, help=help_text,
                           metavar=flag[2:].upper().replace("-", "_"))
    serve.add_argument("--api-key", dest="server.api_keys", action="append", default=None, metavar="KEY",
                       help="accept this Bearer key (repeatable); none: no key needed")
    serve.set_defaults(run=run_serve)


def serve_config(args: argparse.Namespace):  # noqa: ANN201 - EngineConfig
    """--config, then the engine and server flags on top; an unknown reasoning parser fails here."""
    from pluginfer.cli import BOOL_FLAGS, ENGINE_FLAGS
    from pluginfer.core.config import build_config
    from pluginfer.server.reasoning import get_reasoning_parser

    dotted = ([dest for dest, _, _ in ENGINE_FLAGS.values()] + list(BOOL_FLAGS.values())
              + [dest for dest, _, _ in SERVER_FLAGS.values()] + ["server.api_keys"])
    overrides = {dest: getattr(args, dest) for dest in dotted if getattr(args, dest, None) is not None}
    config = build_config(args.config, **overrides)
    if config.server.reasoning_parser:
        get_reasoning_parser(config.server.reasoning_parser)  # before the model loads, not after
    return config


def run_serve(args: argparse.Namespace) -> int:
    from pluginfer.server.launch import run_server

    return run_server(serve_config(args))
