"""Tool calling on /v1/chat/completions: ``tools`` and ``tool_choice`` to a prompt, a grammar and a parser,
and the model's output back to ``message.tool_calls`` / streamed ``delta.tool_calls``.

``none``: plain content. ``auto``: calls in the model's own format (``--tool-call-parser``, ``tool_parsers.py``)
or bare JSON (``json_tool_calls.py``), held to a declared tool by a grammar once its trigger appears where the
parser gives its ``call_syntax`` (``tool_grammar.py``). ``required`` / a named function: constrained decoding
makes the call valid, as vLLM does, read here whatever the model's format. ``allowed_tools``: ``auto`` or
``required`` whose grammar holds calls to a subset of the tools, every tool still in the prompt. Parameters are
strict (``strict_schema.py``) unless ``server.strict_tool_schemas: false``.
"""

from __future__ import annotations

import copy
import json
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pluginfer.core.parsers import ToolCallParser
from pluginfer.engine.strict_schema import strict_json_schema
from pluginfer.engine.structured import StructuredOutputsParams
from pluginfer.server.errors import bad_request
from pluginfer.server.json_tool_calls import json_tool_calls
from pluginfer.server.tool_grammar import auto_tool_grammar

_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # as protocol.py's request bodies


class FunctionDefinition(_Strict):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    # enforced either way (auto: where the parser says how its calls look)
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class _FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: _FunctionName


class AllowedTools(_Strict):
    mode: Literal["auto", "required"]
    tools: list[NamedToolChoice] = Field(min_length=1)


class AllowedToolsChoice(_Strict):
    """OpenAI's ``{"type": "allowed_tools", "allowed_tools": {"mode", "tools"}}``: every tool stays in the prompt,
    the model may call only these."""

    type: Literal["allowed_tools"]
    allowed_tools: AllowedTools


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice | AllowedToolsChoice


def allowed_tools_choice(choice: dict[str, Any], form: type[BaseModel] = AllowedToolsChoice,
                         shape: str = "{type: allowed_tools, allowed_tools: {mode: auto or required, tools: "
                                      "[{type: function, function: {name}}, ...]}}") -> Any:
    """An allowed_tools ``choice`` validated as ``form``, or a ValueError saying what of it is wrong against
    ``shape`` (not what every branch of the tool_choice union wanted)."""
    try:
        return form.model_validate(choice)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise ValueError(f"allowed_tools is {shape}: {problems}") from None


@dataclass
class ToolCalling:
    """What one request asks of tool calling."""

    tools: list[Tool]
    mode: Literal["none", "auto", "required", "named"]
    name: str | None = None  # the named function
    parallel: bool = True
    parser: ToolCallParser | None = None
    special_tokens: list[str] = field(default_factory=list)  # stripped from content when kept for the parser
    # an object without additionalProperties holds only its declared keys
    strict_schemas: bool = True
    allowed: frozenset[str] | None = None  # the tools the model may call (allowed_tools; None: every one)

    @classmethod
    def from_request(cls, tools: list[Tool] | None, choice: ToolChoice | None, parallel: bool | None,
                     parser: Callable[[], ToolCallParser] | None, strict_schemas: bool = True) -> ToolCalling | None:
        """None when the request has no tools; a 400 naming the field for what cannot be served. ``parser``: the
        server's tool_parser plugin factory (``--tool-call-parser``), called for ``tool_choice: auto``;
        ``strict_schemas``: the server's ``strict_tool_schemas``."""
        if not tools:
            if choice is not None and choice != "none" and choice != "auto":
                raise bad_request("tool_choice: a tool can only be chosen from tools, and none were given",
                                  "tool_choice")
            return None
        names = [tool.function.name for tool in tools]
        if len(set(names)) != len(names):
            raise bad_request(f"tools: function names must be unique, got {names}", "tools")
        for i, tool in enumerate(tools):
            parameters = tool.function.parameters
            if parameters is not None and parameters.get("type", "object") != "object":
                raise bad_request(f"tools.{i}.function.parameters: must be a JSON schema of type object",
                                  f"tools.{i}.function.parameters")
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in names:
                raise bad_request(f"tool_choice: no tool named {choice.function.name!r}; tools: {names}",
                                  "tool_choice")
            return cls(tools, "named", choice.function.name, parallel is not False, strict_schemas=strict_schemas)
        allowed = None
        if isinstance(choice, AllowedToolsChoice):
            allowed = frozenset(tool.function.name for tool in choice.allowed_tools.tools)
            for i, tool in enumerate(choice.allowed_tools.tools):
                if tool.function.name not in names:
                    raise bad_request(f"tool_choice.allowed_tools.tools.{i}: no tool named {tool.function.name!r}; "
                                      f"tools: {names}", "tool_choice")
            choice = choice.allowed_tools.mode
        mode = choice or "auto"
        made = None
        if mode == "auto":
            if parser is None:
                raise bad_request("tool_choice: auto (the default with tools) needs the server started with "
                                  "--tool-call-parser; required and a named function work without one",
                                  "tool_choice")
            made = parser()
        return cls(tools, mode, None, parallel is not False, made, strict_schemas=strict_schemas, allowed=allowed)

    @property
    def callable_tools(self) -> list[Tool]:
        """The tools the model may call: ``allowed_tools``' (every one of ``tools`` stays in the prompt)."""
        return [tool for tool in self.tools if self.allowed is None or tool.function.name in self.allowed]

    @property
    def names(self) -> set[str]:
        return {tool.function.name for tool in self.callable_tools}

    def template_tools(self) -> list[dict[str, Any]]:
        return [tool.model_dump(exclude_none=True) for tool in self.tools]

    def parameters(self, name: str) -> dict[str, Any]:
        """The schema the arguments of function ``name`` are held to (strict unless the server says not)."""
        tool = next(tool for tool in self.tools if tool.function.name == name)
        return self._held(tool.function.parameters or _EMPTY_PARAMETERS)

    def _held(self, parameters: dict[str, Any]) -> dict[str, Any]:
        return strict_json_schema(parameters) if self.strict_schemas else parameters

    def parameter_grammars(self) -> list[tuple[StructuredOutputsParams, str]]:
        """Each tool's parameters as a grammar, to compile (a schema that does not is a 400)."""
        return [(_compact(self._held(tool.function.parameters)), f"tools.{i}.function.parameters")
                for i, tool in enumerate(self.tools) if tool.function.parameters is not None]

    def grammar(self) -> StructuredOutputsParams | None:
        """The grammar that makes the call valid: required and named only."""
        if self.mode == "named":
            return _compact(self.parameters(self.name))  # type: ignore[arg-type]
        if self.mode != "required":
            return None
        definitions: dict[str, Any] = {}
        options = []
        for i, tool in enumerate(self.callable_tools):
            definitions.update(_hoisted(self.parameters(tool.function.name), f"tool{i}"))
            options.append({"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
                            "properties": {"name": {"const": tool.function.name},
                                           "parameters": {"$ref": f"#/$defs/tool{i}"}}})
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": options}, "$defs": definitions}
        if not self.parallel:
            schema["maxItems"] = 1
        return _compact(schema)

    def auto_grammar(self, special_tokens: dict[str, int]) -> StructuredOutputsParams | None:
        """Under auto, with a parser that says how its calls look: free text, and once a call's trigger
        appears, a call of a declared tool with arguments held to its parameters. ``special_tokens``: the
        tokenizer's, matched as tokens where the parser's syntax writes them."""
        if self.mode != "auto" or self.parser is None:
            return None
        syntax = tuple(self.parser.call_syntax)
        if not syntax:
            return None
        tools = [(tool.function.name, self.parameters(tool.function.name)) for tool in self.callable_tools]
        return StructuredOutputsParams(grammar=auto_tool_grammar(syntax, tools, special_tokens))

    def new_output(self) -> ToolCallOutput:
        return ToolCallOutput(self)


def _compact(schema: dict[str, Any]) -> StructuredOutputsParams:
    """Calls are read by programs: no whitespace between JSON tokens, so none can run on."""
    return StructuredOutputsParams(json=schema, disable_any_whitespace=True)


def _hoisted(schema: dict[str, Any], name: str) -> dict[str, Any]:
    """``schema`` as ``$defs[name]`` of an enclosing schema: its own ``$defs`` beside it as ``name__X``
    and its local references rewritten to match."""
    schema = copy.deepcopy(schema)
    own = {**schema.pop("definitions", {}), **schema.pop("$defs", {})}

    def rewrite(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#"):
                match = re.fullmatch(r"#/(?:\$defs|definitions)/([^/]+)(.*)", ref)
                node = {**node, "$ref": f"#/$defs/{name}__{match.group(1)}{match.group(2)}" if match
                        else f"#/$defs/{name}{ref[1:]}"}
            return {key: rewrite(value) for key, value in node.items()}
        if isinstance(node, list):
            return [rewrite(value) for value in node]
        return node

    hoisted = {name: rewrite(schema)}
    hoisted.update({f"{name}__{key}": rewrite(value) for key, value in own.items()})
    return hoisted


_CALL_HEAD = re.compile(r'\{"name":"([^"]+)","parameters":')


def _required_calls(text: str) -> list[tuple[str, str]]:
    """The calls of ``required``'s array (compact JSON, as its grammar writes it), each call's arguments as
    written. Cut short by ``max_tokens``: the last call's arguments as far as they came, as a named call's
    are; a call cut before its name is left out. Never the array itself as content."""
    calls: list[tuple[str, str]] = []
    position, decoder = 1, json.JSONDecoder()
    while text.startswith("[") and (head := _CALL_HEAD.match(text, position)) is not None:
        try:
            _, end = decoder.raw_decode(text, head.end())
        except ValueError:
            return [*calls, (head.group(1), text[head.end():])]
        calls.append((head.group(1), text[head.end():end]))
        position = end + 1 + text.startswith(",", end + 1)  # past the call's "}" and a ","
    return calls


class ToolCallOutput:
    """One choice's output text as content and tool calls: whole (``message``) or as stream deltas."""

    def __init__(self, calling: ToolCalling) -> None:
        self.calling = calling
        self.ids: list[str] = []
        self.sent_content = 0
        self.sent_calls = 0
        self.sent_arguments = 0

    def _id(self, index: int) -> str:
        while len(self.ids) <= index:
            parser = self.calling.parser
            self.ids.append(parser.new_id() if parser else f"call_{secrets.token_hex(12)}")
        return self.ids[index]

    def _split(self, text: str, final: bool) -> tuple[str, list[tuple[str, str]]]:
        """(content, [(name, arguments)]) of the text so far."""
        calling = self.calling
        if calling.mode == "named":
            return "", [(calling.name, text)]  # type: ignore[list-item]
        if calling.mode == "required":
            return "", _required_calls(text) if final else []
        if calling.mode == "none" or calling.parser is None:
            return text, []
        parsed = calling.parser.parse(text, final)
        content, bare = json_tool_calls(parsed.content, calling.names, final)  # written before any marked call
        calls = [(call.name, call.arguments) for call in [*bare, *parsed.calls]]
        for token in calling.special_tokens:
            content = content.replace(token, "")
        return content, calls if calling.parallel else calls[:1]

    def message(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, tool_calls) of a finished choice; content None when there are only calls (required and
        named: always)."""
        content, calls = self._split(text, final=True)
        tool_calls = [{"id": self._id(i), "type": "function", "function": {"name": name, "arguments": arguments}}
                      for i, (name, arguments) in enumerate(calls)]
        constrained = self.calling.mode in ("required", "named")  # calls only, even when cut short
        return (content or None) if tool_calls or constrained else content, tool_calls

    def delta(self, text: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        """(content delta, delta.tool_calls entries) since the last call."""
        content, calls = self._split(text, final)
        content_delta = content[self.sent_content:]
        self.sent_content = len(content)
        deltas = []
        if self.calling.mode == "named":
            if self.sent_calls == 0:
                self.sent_calls = 1
                deltas.append({"index": 0, "id": self._id(0), "type": "function",
                               "function": {"name": self.calling.name, "arguments": ""}})
            if len(text) > self.sent_arguments:
                deltas.append({"index": 0, "function": {"arguments": text[self.sent_arguments:]}})
                self.sent_arguments = len(text)
            return content_delta, deltas
        for i in range(self.sent_calls, len(calls)):
            name, arguments = calls[i]
            deltas.append({"index": i, "id": self._id(i), "type": "function",
                           "function": {"name": name, "arguments": arguments}})
        self.sent_calls = max(self.sent_calls, len(calls))
        return content_delta, deltas


