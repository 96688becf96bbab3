"""Structured-output request fields: OpenAI's ``response_format`` and vLLM's ``structured_outputs``.

Both become one :class:`StructuredOutputsParams`; :func:`compile_grammar` compiles it in a worker
thread before the request reaches the engine, so the step loop only copies a cached matcher
and a grammar that does not compile is a 400 naming the request field.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pluginfer.engine.strict_schema import strict_json_schema
from pluginfer.engine.structured import StructuredOutputError, StructuredOutputsParams
from pluginfer.server.errors import bad_request

if TYPE_CHECKING:
    from pluginfer.server.state import ServerState


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # as protocol.py's request bodies


class JsonSchemaFormat(_Strict):
    name: str = Field(max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    # enforced either way; true: also an object without additionalProperties is closed
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def params(self) -> StructuredOutputsParams | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if self.json_schema is None:
            raise bad_request("response_format: type json_schema needs a json_schema object",
                              "response_format.json_schema")
        schema = self.json_schema.schema_
        return StructuredOutputsParams(json=strict_json_schema(schema) if self.json_schema.strict else schema)


class StructuredOutputsRequest(_Strict):
    """vLLM's ``structured_outputs`` (its names since v0.12, which dropped ``guided_json`` & co)."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    whitespace_pattern: str | None = None
    disable_any_whitespace: bool = False

    def params(self) -> StructuredOutputsParams:
        try:
            return StructuredOutputsParams(
                json=self.json_, regex=self.regex, choice=self.choice, grammar=self.grammar,
                json_object=bool(self.json_object), whitespace_pattern=self.whitespace_pattern,
                disable_any_whitespace=self.disable_any_whitespace)
        except StructuredOutputError as exc:
            raise bad_request(f"structured_outputs: {exc}", "structured_outputs") from None


def requested_grammar(response_format: ResponseFormat | None,
                      structured_outputs: StructuredOutputsRequest | None) -> tuple[StructuredOutputsParams, str] | None:
    """(grammar, the request field it came from), or None when the output is free text."""
    if response_format is not None and response_format.type != "text" and structured_outputs is not None:
        raise bad_request("give response_format or structured_outputs, not both", "structured_outputs")
    if structured_outputs is not None:
        return structured_outputs.params(), "structured_outputs"
    if response_format is not None:
        params = response_format.params()
        return (params, "response_format") if params is not None else None
    return None


async def compile_grammar(state: ServerState, params: StructuredOutputsParams, field: str) -> None:
    """Compile (or find in the cache) off the event loop and the engine's step loop; a 400 naming
    ``field`` when the grammar does not compile."""
    try:
        await asyncio.to_thread(state.engine.compile_grammar, params)
    except StructuredOutputError as exc:
        raise bad_request(f"{field}: {exc}", field) from None
