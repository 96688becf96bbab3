"""The deployment config: YAML/JSON files, dotted overrides, field-path errors, schema, sizes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from pluginfer.core.config import ConfigError, EngineConfig, build_config, config_schema

DEPLOY = {
    "model": "/models/tiny",
    "dtype": "bfloat16",
    "cache": {"block_size": 32, "kv_cache_memory": "512MiB", "enable_prefix_caching": False},
    "scheduler": {"max_num_seqs": 8},
    "server": {"port": 9000, "api_keys": ["secret"]},
}


@pytest.fixture(params=["yaml", "json"])
def deploy_file(request, tmp_path) -> Path:
    path = tmp_path / f"deploy.{request.param}"
    path.write_text(yaml.safe_dump(DEPLOY) if request.param == "yaml" else json.dumps(DEPLOY))
    return path


def test_file_values_and_defaults(deploy_file):
    config = build_config(deploy_file)
    assert isinstance(config, EngineConfig)
    assert (config.model, config.dtype) == ("/models/tiny", "bfloat16")
    assert config.cache.block_size == 32 and config.cache.kv_cache_memory == 512 * 2**20
    assert config.cache.enable_prefix_caching is False
    assert config.scheduler.max_num_seqs == 8 and config.scheduler.max_num_batched_tokens == 2048
    assert config.server.port == 9000 and config.server.api_keys == ["secret"]
    assert config.parallel.tensor_parallel_size == 1


def test_dotted_overrides_win_over_the_file(deploy_file):
    config = build_config(deploy_file, model="/models/other", **{
        "cache.block_size": 64, "scheduler.max_num_batched_tokens": 512, "cache.enable_prefix_caching": True,
        "dtype": None,  # an unset CLI flag leaves the file's value
    })
    assert config.model == "/models/other" and config.dtype == "bfloat16"
    assert config.cache.block_size == 64 and config.cache.enable_prefix_caching is True
    assert config.cache.kv_cache_memory == 512 * 2**20  # a sibling the override did not touch
    assert config.scheduler.max_num_batched_tokens == 512 and config.scheduler.max_num_seqs == 8


@pytest.mark.parametrize(("overrides", "field"), [
    ({"cache.block_size": 0}, "cache.block_size"),
    ({"scheduler.max_num_seqs": -1}, "scheduler.max_num_seqs"),
    ({"cache.kv_cache_fraction": 1.5}, "cache.kv_cache_fraction"),
    ({"cache.kv_cache_memory": "-1GiB"}, "cache.kv_cache_memory"),
    ({"server.port": 70000}, "server.port"),
    ({"dtype": "float8"}, "dtype"),
    ({"parallel.launcher": "ssh"}, "parallel.launcher"),
])
def test_invalid_values_name_the_field_path(overrides, field):
    with pytest.raises(ConfigError, match=rf"(^|\W){field}: "):
        build_config(model="m", **overrides)


def test_invalid_value_in_a_file_names_the_field_path(tmp_path):
    path = tmp_path / "deploy.yaml"
    path.write_text("model: m\ncache:\n  block_size: zero\n")
    with pytest.raises(ConfigError, match=r"cache\.block_size: .*'zero'"):
        build_config(path)


@pytest.mark.parametrize(("data", "field"), [
    ({"model": "m", "cache": {"blok_size": 8}}, "cache.blok_size"),
    ({"model": "m", "modle": "m2"}, "modle"),
    ({"model": "m", "sampling": {"temprature": 0.5}}, "sampling.temprature"),
])
def test_unknown_fields_are_rejected_by_name(tmp_path, data, field):
    path = tmp_path / "deploy.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=rf"{field}: Extra inputs are not permitted"):
        build_config(path)


def test_the_model_is_required():
    with pytest.raises(ConfigError, match="model: Field required"):
        build_config()


def test_unreadable_files_say_which_and_why(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        build_config(tmp_path / "absent.yaml")
    broken = tmp_path / "broken.json"
    broken.write_text("{model: ")
    with pytest.raises(ConfigError, match=r"broken\.json is not valid JSON"):
        build_config(broken)
    listed = tmp_path / "list.yaml"
    listed.write_text("- model: m\n")
    with pytest.raises(ConfigError, match="mapping"):
        build_config(listed)


def test_schema_is_json_and_holds_every_section():
    schema = json.loads(json.dumps(config_schema()))
    assert {"model", "dtype", "parallel", "cache", "scheduler", "server", "sampling"} <= set(schema["properties"])
    assert schema["required"] == ["model"]
    assert schema["additionalProperties"] is False
    cache = schema["$defs"]["CacheConfig"]
    assert cache["additionalProperties"] is False
    assert cache["properties"]["block_size"]["minimum"] == 1


@pytest.mark.parametrize(("text", "size"), [
    ("2GiB", 2 * 2**30), ("512MiB", 512 * 2**20), ("512MB", 512 * 10**6), ("1.5GiB", 3 * 2**29),
    ("64kib", 64 * 1024), ("2 gb", 2 * 10**9), ("4096", 4096), (4096, 4096), (" 10K ", 10_000),
])
def test_kv_cache_memory_takes_sizes(text, size):
    assert build_config(model="m", **{"cache.kv_cache_memory": text}).cache.kv_cache_memory == size


@pytest.mark.parametrize("text", ["", "GiB", "two GiB", "2 GiBs", "nan", 0])
def test_kv_cache_memory_rejects_what_is_not_a_size(text):
    with pytest.raises(ConfigError, match=r"cache\.kv_cache_memory"):
        build_config(model="m", **{"cache.kv_cache_memory": text})


def test_an_infinite_size_names_the_field():
    with pytest.raises(ConfigError, match=r"cache\.kv_cache_memory"):
        build_config(model="m", **{"cache.kv_cache_memory": "inf"})


def test_parallel_section_from_a_deployment_file_and_flags(tmp_path) -> None:
    path = tmp_path / "deploy.yaml"
    path.write_text("model: demo\nparallel:\n  tensor_parallel_size: 2\n  pipeline_parallel_size: 2\n"
                    "  collective: gloo\n  launcher: torchrun\n  timeout_s: 30\n")
    config = build_config(path, **{"parallel.pipeline_parallel_size": 1})
    parallel = config.parallel
    assert (parallel.tensor_parallel_size, parallel.pipeline_parallel_size) == (2, 1)  # the flag wins
    assert (parallel.collective, parallel.launcher, parallel.timeout_s) == ("gloo", "torchrun", 30.0)
