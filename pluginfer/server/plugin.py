"""Registers the built-in tool-call and reasoning parsers (cheap: the parser modules load when selected)."""

from pluginfer.core.hookspecs import ReasoningParserSpec, ToolParserSpec, hookimpl

_TOOLS = "pluginfer.server.tool_parsers"
_REASONING = "pluginfer.server.reasoning"


@hookimpl
def pluginfer_tool_parsers() -> list[ToolParserSpec]:
    return [
        ToolParserSpec(name="hermes", aliases=("qwen",), factory=f"{_TOOLS}:HermesToolParser",
                       description="<tool_call>{json}</tool_call>: Hermes 2 Pro, Qwen2.5, Qwen3, QwQ"),
        ToolParserSpec(name="llama3_json", factory=f"{_TOOLS}:Llama3JsonToolParser",
                       description='Llama 3.1-3.3 JSON calls ({"name", "parameters"}, <|python_tag|>)'),
        ToolParserSpec(name="mistral", factory=f"{_TOOLS}:MistralToolParser",
                       description="[TOOL_CALLS] of Mistral tokenizers v3 and v11+"),
        ToolParserSpec(name="deepseek_v3", aliases=("deepseek_v31",), factory=f"{_TOOLS}:DeepSeekV3ToolParser",
                       description="DeepSeek V3, R1-0528, V3.1 tool-call blocks"),
    ]


@hookimpl
def pluginfer_reasoning_parsers() -> list[ReasoningParserSpec]:
    return [
        ReasoningParserSpec(name="deepseek_r1", factory=f"{_REASONING}:DeepSeekR1ReasoningParser",
                            description="reasoning until </think> (the template may open <think>)"),
        ReasoningParserSpec(name="qwen3", factory=f"{_REASONING}:Qwen3ReasoningParser",
                            description="reasoning only when the output opens with <think>"),
    ]
