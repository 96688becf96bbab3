"""Registration only: what this plugin provides and where its factories live."""

from pluginfer.core.hookspecs import ReasoningParserSpec, ToolParserSpec, hookimpl


@hookimpl
def pluginfer_tool_parsers() -> list[ToolParserSpec]:
    return [ToolParserSpec(name="memo", factory="pluginfer_example_parser.parsers:MemoToolParser",
                           description="<<call NAME {json}>> tool calls of the memo chat format")]


@hookimpl
def pluginfer_reasoning_parsers() -> list[ReasoningParserSpec]:
    return [ReasoningParserSpec(name="memo", factory="pluginfer_example_parser.parsers:MemoReasoningParser",
                                description="reasoning until ~~ in the memo chat format")]
