"""No request field is silently ignored: what this server cannot do is a 400 naming the field.

Each request model declares the fields it honours. Fields of OpenAI's request schemas that it
cannot honour are listed here with the values that ask for nothing (``store: false``,
``modalities: ["text"]``): those pass, any other value is a 400 saying why. A field that is
neither declared nor listed is unknown: also a 400. ``tests/server/test_request_fields.py``
walks OpenAI's published spec and checks that every field is honoured or refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, model_validator

from pluginfer.server.errors import APIError


@dataclass(frozen=True)
class Unsupported:
    """A field this server does not implement; ``accepted`` are the values that ask for nothing."""

    why: str
    accepted: tuple[Any, ...] = (None,)


# Accepted and without effect: OpenAI's account-side identifiers and tags, which change nothing in an answer.
INFORMATIONAL = frozenset({"user", "safety_identifier", "prompt_cache_key", "metadata"})

_SHARED: dict[str, Unsupported] = {
    **{f"guided_{kind}": Unsupported(f"removed in vLLM 0.12: use structured_outputs: {{{kind}: ...}}")
       for kind in ("json", "regex", "choice", "grammar", "whitespace_pattern")},
    "guided_decoding_backend": Unsupported("removed in vLLM 0.12; llguidance serves structured_outputs"),
}

CHAT: dict[str, Unsupported] = {
    **_SHARED,
    "audio": Unsupported("audio output is not supported"),
    "modalities": Unsupported("only text output is supported", (None, ["text"])),
    "web_search_options": Unsupported("web search is not supported"),
    "prediction": Unsupported("predicted outputs are not supported"),
    "moderation": Unsupported("moderation is not supported"),
    "verbosity": Unsupported("verbosity is not supported: no served model reads it"),
    "functions": Unsupported("the deprecated functions field is not supported; use tools"),
    "function_call": Unsupported("the deprecated function_call field is not supported; use tool_choice"),
    "store": Unsupported("completions are not stored", (None, False)),
    "service_tier": Unsupported("this server has one service tier", (None, "auto", "default")),
    "prompt_cache_retention": Unsupported("the prefix cache lives in memory only", (None, "in_memory")),
    "prompt_cache_options": Unsupported("the prefix cache is automatic and has no options", (None, {})),
}

COMPLETION: dict[str, Unsupported] = dict(_SHARED)


RESPONSES: dict[str, Unsupported] = {
    "background": Unsupported("responses run in the foreground only", (None, False)),
    "conversation": Unsupported("the Conversations API is not served; use previous_response_id"),
    "context_management": Unsupported("context management (compaction) is not supported"),
    "include": Unsupported("no additional output data is served", (None, [])),
    "max_tool_calls": Unsupported("built-in tools are not served"),
    "moderation": Unsupported("moderation is not supported"),
    "prompt": Unsupported("prompt templates are not served"),
    "service_tier": Unsupported("this server has one service tier", (None, "auto", "default")),
    "prompt_cache_retention": Unsupported("the prefix cache lives in memory only", (None, "in_memory")),
    "prompt_cache_options": Unsupported("the prefix cache is automatic and has no options", (None, {})),
    "top_logprobs": Unsupported("logprobs are not served on /v1/responses; use /v1/chat/completions", (None, 0)),
    "truncation": Unsupported("a conversation longer than the context is a 400, never truncated",
                              (None, "disabled")),
}

EMBEDDING: dict[str, Unsupported] = {}  # every field of CreateEmbeddingRequest is honoured


def check_fields(data: Any, declared: set[str], unsupported: dict[str, Unsupported]) -> Any:
    """Raise a 400 for the first field of ``data`` that is unknown or asks for what is not supported;
    return ``data`` without the unsupported fields that asked for nothing."""
    if not isinstance(data, dict):
        return data
    for name, value in data.items():
        rule = unsupported.get(name)
        if rule is not None:
            if not any(value == ok and type(value) is type(ok) for ok in rule.accepted):
                raise APIError(400, f"{name}: {rule.why}; accepted values: "
                               f"{', '.join(_show(ok) for ok in rule.accepted)}", name)
        elif name not in declared:
            raise APIError(400, f"{name}: unknown field; this server does not support it", name)
    return {name: value for name, value in data.items() if name not in unsupported}


def _show(value: Any) -> str:
    return json.dumps(value)


class CheckedRequest(BaseModel):
    """A request body that honours or refuses each field it is sent (``check_fields`` against ``UNSUPPORTED``)."""

    model_config = ConfigDict(extra="ignore", strict=True)  # check_fields refuses unknown fields, naming them
    UNSUPPORTED: ClassVar[dict[str, Unsupported]] = {}

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        return check_fields(data, set(cls.model_fields), cls.UNSUPPORTED)


def check_metadata(metadata: dict[str, str] | None) -> dict[str, str] | None:
    """OpenAI's limits on ``metadata``: at most 16 pairs, keys up to 64 characters, values up to 512."""
    if metadata is not None and (len(metadata) > 16 or any(len(k) > 64 or len(v) > 512 for k, v in metadata.items())):
        raise ValueError("at most 16 pairs, keys up to 64 characters, values up to 512")
    return metadata
