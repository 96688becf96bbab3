"""Every ``EngineConfig`` field as a command-line flag and an ``LLM()`` keyword, generated from the model.

A field's flag is its name with dashes (``cache.block_size`` -> ``--block-size``); its type, choices
(``Literal``), description and default come from the pydantic field; booleans take ``--x/--no-x``;
lists repeat the flag. ``FLAG_NAMES`` keeps the few spellings that differ from the generated ones.
``LLM()`` takes a field by its dotted name, its own name, or its flag without dashes.
"""

from __future__ import annotations

import argparse
import types
import typing
from dataclasses import dataclass
from functools import cache
from typing import Any, Literal

from pydantic import BaseModel, ByteSize

from pluginfer.core.config import EngineConfig

# Dotted field -> its flag, where that is not the generated one.
FLAG_NAMES = {
    "parallel.timeout_s": "--distributed-timeout",
    "server.api_keys": "--api-key",  # one key per flag, repeatable
    "server.endpoints": "--endpoint",
    "server.request_processors": "--request-processor",
    "speculative_config.method": "--speculative-method",
    "speculative_config.model": "--speculative-model",
}
# Sections whose flags take a prefix: sampling defaults would clash with a request's --temperature.
FLAG_PREFIXES = {"sampling": "default-"}
# Sections every engine command takes; ``serve`` adds ``server``.
ENGINE_SECTIONS = ("", "parallel", "cache", "scheduler", "sampling", "speculative_config", "lora", "testing")
# The --help group of each section's flags; a section not here (testing: fault injection) is left out of --help.
SECTION_TITLES = {
    "": "model and engine",
    "parallel": "parallel (config section parallel:)",
    "cache": "KV cache (config section cache:)",
    "scheduler": "scheduler (config section scheduler:)",
    "sampling": "request defaults (config section sampling:; what a request that sets none gets)",
    "speculative_config": "speculative decoding (config section speculative_config:)",
    "lora": "LoRA adapters (config section lora:)",
    "server": "server (config section server:)",
}


@dataclass(frozen=True)
class Option:
    """One config field: where it lives, how the command line and ``LLM()`` name it, how to parse it."""

    dotted: str
    section: str
    flag: str
    kind: Any  # what argparse converts the text with
    choices: tuple | None
    boolean: bool
    repeatable: bool
    help: str

    @property
    def keywords(self) -> tuple[str, ...]:
        """The ``LLM()`` keywords besides the dotted name: the field's own name and the flag's."""
        leaf = self.dotted.rpartition(".")[2]
        from_flag = self.flag[2:].replace("-", "_")
        if "." in self.dotted and leaf in EngineConfig.model_fields:  # speculative_config.model: not LLM(model=)
            return (from_flag,)
        return (leaf,) if from_flag == leaf else (leaf, from_flag)


def _unwrap(annotation: Any) -> Any:
    """``int | None`` -> ``int``."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _option(dotted: str, section: str, field: Any) -> Option:
    annotation = _unwrap(field.annotation)
    origin = typing.get_origin(annotation)
    leaf = dotted.rpartition(".")[2]
    flag = FLAG_NAMES.get(dotted, f"--{FLAG_PREFIXES.get(section, '')}{leaf.replace('_', '-')}")
    choices = tuple(typing.get_args(annotation)) if origin is Literal else None
    repeatable = origin is list
    if choices:
        kind = type(choices[0])
    elif repeatable:
        kind = typing.get_args(annotation)[0]
    elif annotation in (int, float, str, bool):
        kind = annotation
    else:  # e.g. ByteSize: pydantic parses the text ("2GiB")
        kind = str
    default = field.get_default(call_default_factory=True)
    if isinstance(default, ByteSize):
        default = default.human_readable(decimal=False)
    described = field.description or ""
    described = described[:-1] if described.endswith(".") and not described.endswith("...") else described
    shown = "" if default in (None, [], "") or field.is_required() else f" (default {default})"
    return Option(dotted, section, flag, kind, choices, annotation is bool, repeatable, f"{described}{shown}".strip())


@cache
def options() -> tuple[Option, ...]:
    """One ``Option`` per leaf field of ``EngineConfig``, sections in their order."""
    found = []
    for name, field in EngineConfig.model_fields.items():
        annotation = _unwrap(field.annotation)
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            found += [_option(f"{name}.{leaf}", name, sub) for leaf, sub in annotation.model_fields.items()]
        else:
            found.append(_option(name, "", field))
    return tuple(found)


def add_arguments(parser: argparse.ArgumentParser, sections: tuple[str, ...] = ENGINE_SECTIONS) -> None:
    """The flags of every field in ``sections`` (``""``: the top-level fields), one --help group per section
    (a section without a title in ``SECTION_TITLES`` is accepted but not shown); each defaults to None."""
    groups: dict[str, Any] = {}
    for option in options():
        if option.section not in sections:
            continue
        title = SECTION_TITLES.get(option.section)
        if title is not None and option.section not in groups:
            groups[option.section] = parser.add_argument_group(title)
        group = groups.get(option.section, parser)
        shown = option.help if title is not None else argparse.SUPPRESS
        metavar = option.flag[2:].upper().replace("-", "_")
        if option.boolean:
            group.add_argument(option.flag, dest=option.dotted, action=argparse.BooleanOptionalAction,
                               default=None, help=shown)
        elif option.repeatable:
            group.add_argument(option.flag, dest=option.dotted, type=option.kind, action="append", default=None,
                               metavar=metavar, help=shown if title is None else f"{option.help} (repeatable)")
        else:
            group.add_argument(option.flag, dest=option.dotted, type=option.kind, choices=option.choices,
                               default=None, metavar=None if option.choices else metavar, help=shown)


def overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The dotted fields whose flags were given: what ``build_config`` lays over ``--config``."""
    return {option.dotted: getattr(args, option.dotted) for option in options()
            if getattr(args, option.dotted, None) is not None}


@cache
def keywords() -> dict[str, str]:
    """``LLM()`` keyword -> dotted field, for every field."""
    table: dict[str, str] = {}
    for option in options():
        for keyword in (option.dotted, *option.keywords):
            if table.setdefault(keyword, option.dotted) != option.dotted:
                raise RuntimeError(f"LLM() keyword {keyword!r} names both {table[keyword]} and {option.dotted}")
    return table


def dotted_keywords(kwargs: dict[str, Any], caller: str = "LLM()") -> dict[str, Any]:
    """``block_size=32`` -> ``{"cache.block_size": 32}``; a whole section (``cache={...}``) passes as it is."""
    table = keywords()
    dotted = {}
    for key, value in kwargs.items():
        if key in EngineConfig.model_fields:
            dotted[key] = value
        elif key in table:
            dotted[table[key]] = value
        else:
            raise TypeError(f"{caller} got an unknown argument {key!r} (see `pluginfer config-schema`)")
    return dotted
