"""``pluginfer serve`` flags: they land in the config (over --config); bad ones fail before loading."""

from __future__ import annotations

import pytest

from pluginfer.cli import build_parser, main
from pluginfer.cli.options import overrides
from pluginfer.cli.serve import serve_config
from pluginfer.core.config import build_config
from pluginfer.core.registry import UnknownPluginError


def test_flags_override_the_config_file(tmp_path):
    deploy = tmp_path / "deploy.yaml"
    deploy.write_text("model: some/model\nserver:\n  port: 9000\n  max_waiting: 7\n  api_keys: [from-file]\n")
    args = build_parser().parse_args([
        "serve", "--config", str(deploy), "--host", "0.0.0.0", "--served-model-name", "m",
        "--api-key", "a", "--api-key", "b", "--reasoning-parser", "qwen3", "--max-num-seqs", "4",
        "--tool-call-parser", "hermes", "--endpoint", "a", "--endpoint", "b", "--request-processor", "c"])
    with pytest.raises(UnknownPluginError, match="no endpoint plugin named 'a'"):
        serve_config(args)  # the names are checked before anything loads
    config = build_config(deploy, **overrides(args))
    server = config.server
    assert (server.endpoints, server.request_processors) == (["a", "b"], ["c"])
    assert (server.host, server.port, server.max_waiting) == ("0.0.0.0", 9000, 7)
    assert server.api_keys == ["a", "b"] and server.served_model_name == "m"
    assert server.reasoning_parser == "qwen3" and config.scheduler.max_num_seqs == 4
    assert server.tool_call_parser == "hermes"
    defaults = serve_config(build_parser().parse_args(["serve", "--model", "x"])).server
    assert (defaults.host, defaults.port, defaults.api_keys) == ("127.0.0.1", 8000, [])


def test_bad_flags_fail_before_the_model_loads(capsys):
    assert main(["serve", "--model", "/no/such/model", "--reasoning-parser", "nope"]) == 2
    assert "deepseek_r1" in capsys.readouterr().err
    assert main(["serve", "--model", "/no/such/model", "--tool-call-parser", "nope"]) == 2
    assert "no tool_parser plugin named 'nope'; available: deepseek_v3, deepseek_v31, hermes, llama3_json" \
        in capsys.readouterr().err
    assert main(["serve", "--model", "/no/such/model", "--endpoint", "nope"]) == 2
    assert "no endpoint plugin named 'nope'" in capsys.readouterr().err
    assert main(["serve", "--model", "/no/such/model", "--request-processor", "nope"]) == 2
    assert "no request_processor plugin named 'nope'" in capsys.readouterr().err
    assert main(["serve", "--model", "/no/such/model", "--port", "70000"]) == 2
    assert "server.port" in capsys.readouterr().err
