"""cli/options.py: every EngineConfig field is a flag of `pluginfer serve` (the engine commands take all
but the server's) and an LLM() keyword, generated from the model; today's spellings keep working."""

from __future__ import annotations

import functools

import pytest

from pluginfer.cli import build_parser
from pluginfer.cli.options import ENGINE_SECTIONS, dotted_keywords, options, overrides
from pluginfer.core.config import EngineConfig, build_config


def value_at(config: EngineConfig, dotted: str) -> object:
    return functools.reduce(getattr, dotted.split("."), config)


def default_of(dotted: str) -> object:
    # speculative_config is unset by default; its fields' defaults are those of a section that names its one required field
    section = {"speculative_config.num_speculative_tokens": 1} if dotted.startswith("speculative_config.") else {}
    return value_at(build_config(model="m", **section), dotted)


def flag_words(option) -> tuple[list[str], object]:
    """Flags that set ``option`` and the value the config should then hold (not the default where it can)."""
    if option.dotted == "model":
        return [option.flag, "m2"], "m2"
    if option.dotted.startswith("speculative_config.m"):  # the draft model and its method go together
        value = "draft" if option.dotted.endswith("model") else "draft_model"
        return [option.flag, value], value
    default = default_of(option.dotted)
    if option.boolean:
        return ([f"--no-{option.flag[2:]}"] if default else [option.flag]), not default
    if option.choices:
        choice = next(c for c in option.choices if c != default)
        return [option.flag, str(choice)], choice
    if option.repeatable:
        return [option.flag, "a", option.flag, "b"], ["a", "b"]
    if default is not None:
        return [option.flag, str(default)], default
    for text in ("8", "0.5", "x"):  # the first the field accepts
        try:
            return [option.flag, text], value_at(build_config(model="m", **{option.dotted: text}), option.dotted)
        except ValueError:
            continue
    raise AssertionError(f"no sample value for {option.dotted}")


def test_every_field_is_a_flag_of_serve() -> None:
    assert {option.section for option in options()} == set(ENGINE_SECTIONS) | {"server"}
    words, expected = [], {}
    for option in options():
        flags, value = flag_words(option)
        words += flags
        expected[option.dotted] = value
    args = build_parser().parse_args(["serve", *words])
    assert set(overrides(args)) == set(expected)
    config = build_config(args.config, **overrides(args))
    assert {dotted: value_at(config, dotted) for dotted in expected} == expected


@pytest.mark.parametrize("command", [["generate", "--prompt", "p"], ["chat"], ["bench", "throughput",
                                     "--input-len", "1", "--output-len", "1", "--num-prompts", "1"]])
def test_every_engine_field_is_a_flag_of_the_engine_commands(command: list[str]) -> None:
    parser = build_parser()
    for option in options():
        if option.section == "server":
            continue
        flags, _ = flag_words(option)
        assert option.dotted in overrides(parser.parse_args([*command, *flags])), option.flag


def test_every_field_is_an_llm_keyword() -> None:
    for option in options():
        for keyword in (option.dotted, *option.keywords):
            assert dotted_keywords({keyword: 1}) == {option.dotted: 1}
    assert dotted_keywords({"cache": {"block_size": 8}}) == {"cache": {"block_size": 8}}
    with pytest.raises(TypeError, match="unknown argument 'blok_size'"):
        dotted_keywords({"blok_size": 8})


def test_todays_spellings_still_work() -> None:
    args = build_parser().parse_args([
        "serve", "--model", "m", "--distributed-timeout", "5", "--kv-cache-memory", "2GiB",
        "--no-enable-prefix-caching", "--api-key", "k1", "--api-key", "k2", "--max-num-seqs", "4",
        "--default-temperature", "0.5", "--port", "0"])
    config = build_config(args.config, **overrides(args))
    assert config.parallel.timeout_s == 5 and config.cache.kv_cache_memory == 2 * 2**30
    assert not config.cache.enable_prefix_caching and config.server.api_keys == ["k1", "k2"]
    assert config.scheduler.max_num_seqs == 4 and config.sampling.temperature == 0.5 and config.server.port == 0
    assert dotted_keywords({"distributed_timeout": 5, "timeout_s": 6, "kv_cache_memory": "1GiB"}) == {
        "parallel.timeout_s": 6, "cache.kv_cache_memory": "1GiB"}


def test_bad_choices_fail_in_argparse(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--prompt", "p", "--dtype", "float64"])
    assert "argument --dtype: invalid choice: 'float64'" in capsys.readouterr().err
