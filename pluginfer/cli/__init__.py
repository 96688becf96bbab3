"""The ``pluginfer`` command: plugins, config-schema, generate, chat, serve, bench, convert."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable

from pluginfer import __version__

# flag -> dotted EngineConfig field; every engine command accepts these and they override --config.
ENGINE_FLAGS: dict[str, tuple[str, type | None, str]] = {
    "--model": ("model", str, "HF checkpoint directory, hub id, or 'demo' (a random model: noise)"),
    "--tokenizer": ("tokenizer", str, "tokenizer directory, if not the model's"),
    "--revision": ("revision", str, "hub revision"),
    "--backend": ("backend", str, "device backend plugin (default auto)"),
    "--dtype": ("dtype", str, "auto, float32, float16, bfloat16"),
    "--quant": ("quant", str, "quant method plugin (default auto: from the checkpoint)"),
    "--max-model-len": ("max_model_len", int, "context length (default the model's)"),
    "--seed": ("seed", int, "engine seed"),
    "--tensor-parallel-size": ("parallel.tensor_parallel_size", int, "ranks that split each layer"),
    "--pipeline-parallel-size": ("parallel.pipeline_parallel_size", int, "pipeline stages (layers split in runs)"),
    "--collective": ("parallel.collective", str, "collective plugin: auto, gloo, nccl, mpi, ..."),
    "--launcher": ("parallel.launcher", str, "auto, inprocess, spawn, torchrun, mpi (auto reads the environment)"),
    "--master-addr": ("parallel.master_addr", str, "rendezvous address of spawned ranks"),
    "--master-port": ("parallel.master_port", int, "rendezvous port (0: a free one)"),
    "--distributed-timeout": ("parallel.timeout_s", float, "seconds a rank may stay silent before it is lost"),
    "--block-size": ("cache.block_size", int, "tokens per KV block"),
    "--num-blocks": ("cache.num_blocks", int, "exact number of KV blocks"),
    "--kv-cache-memory": ("cache.kv_cache_memory", str, "KV cache size, e.g. 2GiB"),
    "--kv-cache-fraction": ("cache.kv_cache_fraction", float, "fraction of free memory for the KV cache"),
    "--num-experts-offload-per-rank": ("cache.num_experts_offload_per_rank", int, "MoE experts kept on the host"),
    "--max-num-seqs": ("scheduler.max_num_seqs", int, "sequences per step at most"),
    "--max-num-batched-tokens": ("scheduler.max_num_batched_tokens", int, "token budget per step"),
}
BOOL_FLAGS = {
    "prefix-caching": "cache.enable_prefix_caching",
    "chunked-prefill": "scheduler.enable_chunked_prefill",
}


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="deployment file (YAML or JSON); flags override it")
    for flag, (dest, kind, help_text) in ENGINE_FLAGS.items():
        parser.add_argument(flag, dest=dest, type=kind, default=None, help=help_text)
    for name, dest in BOOL_FLAGS.items():
        parser.add_argument(f"--enable-{name}", dest=dest, action="store_true", default=None)
        parser.add_argument(f"--no-enable-{name}", dest=dest, action="store_false")


def engine_config(args: argparse.Namespace):  # noqa: ANN201 - EngineConfig
    from pluginfer.core.config import build_config

    dotted = [dest for dest, _, _ in ENGINE_FLAGS.values()] + list(BOOL_FLAGS.values())
    overrides = {dest: getattr(args, dest) for dest in dotted if getattr(args, dest, None) is not None}
    return build_config(args.config, **overrides)


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
    from pluginfer.core.registry import PluginError

    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    run: Callable[[argparse.Namespace], int] = args.run
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
