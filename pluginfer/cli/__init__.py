"""The ``pluginfer`` command: plugins, config-schema, generate, chat, serve, bench, convert."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from pluginfer import __version__

if TYPE_CHECKING:
    from pluginfer.core.config import EngineConfig

def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """``--config`` and a flag for every engine field (``pluginfer.cli.options``); flags override the file."""
    from pluginfer.cli.options import add_arguments

    parser.add_argument("--config", help="deployment file (YAML or JSON); flags override it")
    parser.add_argument("--speculative-config", type=_json_object, metavar="JSON",
                        help='speculative decoding as vLLM takes it, e.g. \'{"method": "ngram", '
                        '"num_speculative_tokens": 4}\'; the speculative flags override its keys')
    add_arguments(parser)


def engine_overrides(args: argparse.Namespace) -> dict:
    """The dotted fields the flags set, ``--speculative-config`` under the flags of its section."""
    from pluginfer.cli.options import overrides

    flags = overrides(args)
    return {"speculative_config": args.speculative_config, **flags} if args.speculative_config else flags


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """--config, then the flags given on top; ``--model demo`` becomes the built demo checkpoint."""
    from pluginfer.core.config import build_config
    from pluginfer.demo.model import with_demo_model

    return with_demo_model(build_config(args.config, **engine_overrides(args)))


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def _plugins(args: argparse.Namespace) -> int:
    from pluginfer.core.registry import get_registry

    print(get_registry().describe())
    return 0


def _config_schema(args: argparse.Namespace) -> int:
    from pluginfer.core.config import config_schema

    print(json.dumps(config_schema(), indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    from pluginfer.cli import bench, convert, generate, serve

    parser = argparse.ArgumentParser(prog="pluginfer", description=__doc__)
    parser.add_argument("--version", action="version", version=f"pluginfer {__version__}")
    parser.add_argument("--log-level", default="WARNING", help="DEBUG, INFO, WARNING (default), ERROR")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands.add_parser("plugins", help="list installed plugins, what they register, usable here or not"
                        ).set_defaults(run=_plugins)
    commands.add_parser("config-schema", help="print the JSON schema of the deployment config"
                        ).set_defaults(run=_config_schema)
    generate.register(commands, add_engine_arguments)
    serve.register(commands, add_engine_arguments)
    bench.register(commands, add_engine_arguments)
    convert.register(commands, add_engine_arguments)
    return parser


def main(argv: list[str] | None = None) -> int:
    from pluginfer.engine.launcher_env import external_launcher, leave_launched_rank

    argv = sys.argv[1:] if argv is None else argv
    if _serves_through_a_core_process(argv, external_launcher()):
        from pluginfer.server.core_process import prespawn

        # its interpreter and imports overlap the parser's and the config's here
        prespawn()
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    run: Callable[[argparse.Namespace], int] = args.run
    code = _run(run, args)
    # under torchrun/mpiexec: the engine stopped, leave without finalization
    leave_launched_rank(code)
    return code


def _serves_through_a_core_process(argv: list[str], launcher: str | None) -> bool:
    """Whether ``argv`` is likely a `pluginfer serve` whose engine core gets a process of its own with the
    default environment (the config decides; a process spawned for it ahead is discarded when it does not)."""
    return (argv[:1] == ["serve"] and not {"-h", "--help"} & set(argv) and launcher is None
            and os.environ.get("PLUGINFER_ENGINE_PROCESS", "1") != "0"
            and not any(arg.startswith("--core-spin-count") for arg in argv))


def _run(run: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    from pluginfer.core.registry import PluginError

    try:
        return run(args)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # e.g. `pluginfer config-schema | head`
        sys.stderr.close()
        return 0
    except (ValueError, FileNotFoundError, KeyError, PluginError) as exc:
        # pluginfer's own errors (config, model path, plugins, checkpoint) say what is wrong in one line.
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"pluginfer: error: {message}", file=sys.stderr)
        return 2
