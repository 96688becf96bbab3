"""docs/protocols.md from the contracts themselves: every member of every plugin-facing protocol and value class
in ``pluginfer/core`` (and the backend base class in ``pluginfer/layers``), with its signature and docstring.
``python -m tests.protocol_reference`` rewrites the page; tests/test_protocol_reference.py fails while it is
out of date."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "pluginfer"
PAGE = PACKAGE.parent / "docs" / "protocols.md"
# (module file under pluginfer/, classes in the order a plugin author meets them)
SECTIONS = [
    ("core/protocols.py", ["ModelPipeline", "BuildContext", "ShardSpec", "KVCacheSpec", "IntermediateTensors",
                           "QuantMethod", "VocabTable", "RankInfo", "MultiModalProcessor", "MultiModalPrompt"]),
    ("core/device_backend.py", ["DeviceBackend", "DecodeForward"]),
    ("core/collective.py", ["Collective"]),
    ("core/batch.py", ["ForwardBatch"]),
    ("core/parsers.py", ["ToolCallParser", "ToolCallSyntax", "ToolCallText", "FunctionCall", "ReasoningParser"]),
    ("core/serving.py", ["EndpointContext", "ServingEngine", "RequestProcessor", "PromptRequest",
                         "RequestProcessorError"]),
    ("core/checkpoint.py", ["Checkpoint", "CheckpointError", "ModelNotFoundError"]),
    ("core/speculative.py", ["Proposer", "DraftRequest"]),
    ("core/kernels.py", ["define_op", "implement", "KernelTable", "KernelOp"]),
    ("layers/backend_base.py", ["BaseDeviceBackend"]),
]
HEADER = """# Protocol reference

Every member the core calls on a plugin, and the values it hands over, as `pluginfer/core` declares them:
the signature and the contract (the docstring); last, the base class a backend may subclass. Generated from the code (`python -m tests.protocol_reference`;
a test fails while this page is out of date). How to register each kind: `docs/plugins.md`.
"""


def _indented(text: str) -> str:
    """A docstring as a member's indented paragraph under its list item."""
    return "\n".join(f"  {line}" if line else "" for line in inspect.cleandoc(text).splitlines())


def _members(cls: ast.ClassDef) -> list[str]:
    lines: list[str] = []
    body = cls.body
    for index, node in enumerate(body):
        following = body[index + 1] if index + 1 < len(body) else None
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if node.target.id.startswith("_"):
                continue
            entry = f"- `{node.target.id}: {ast.unparse(node.annotation)}`"
            if isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant) \
                    and isinstance(following.value.value, str):
                entry += "\n" + _indented(following.value.value)
            lines.append(entry)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
            is_property = any(isinstance(d, ast.Name) and d.id == "property" for d in node.decorator_list)
            returns = f" -> {ast.unparse(node.returns)}" if node.returns else ""
            signature = f"{node.name}{returns}" if is_property else f"{node.name}({ast.unparse(node.args)}){returns}"
            entry = f"- `{signature}`"
            doc = ast.get_docstring(node, clean=True)
            lines.append(entry + ("\n" + _indented(doc) if doc else ""))
    return lines


def render() -> str:
    out = [HEADER]
    for module, names in SECTIONS:
        tree = ast.parse((PACKAGE / module).read_text())
        nodes = {node.name: node for node in tree.body if isinstance(node, (ast.ClassDef, ast.FunctionDef))}
        out.append(f"## `pluginfer.{module[:-3].replace('/', '.')}`\n")
        for name in names:
            cls = nodes[name]
            if isinstance(cls, ast.FunctionDef):
                returns = f" -> {ast.unparse(cls.returns)}" if cls.returns else ""
                out.append(f"### `{name}({ast.unparse(cls.args)}){returns}`\n")
                out.append((ast.get_docstring(cls, clean=True) or "") + "\n")
                continue
            bases = ", ".join(ast.unparse(b) for b in cls.bases)
            out.append(f"### `{name}`" + (f" ({bases})" if bases else "") + "\n")
            doc = ast.get_docstring(cls, clean=True)
            if doc:
                out.append(doc + "\n")
            members = _members(cls)
            if members:
                out.append("\n".join(members) + "\n")
    return "\n".join(out)


if __name__ == "__main__":
    PAGE.write_text(render())
    print(f"wrote {PAGE}")
