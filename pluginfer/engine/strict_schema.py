"""Strict JSON schemas: an object that does not say ``additionalProperties`` holds only the keys it declares.

JSON Schema lets an object carry any key its schema does not mention unless ``additionalProperties`` says
otherwise, and llguidance follows the letter of it, so a random or weak model adds keys a tool never
declared. OpenAI's strict mode and xgrammar (vLLM's default backend) read an absent
``additionalProperties`` as ``false``; :func:`strict_json_schema` writes that reading into the schema.
"""

from __future__ import annotations

import copy
import re
from typing import Any

_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("prefixItems",)
# Not "not" and "if": closing an object there would widen what the schema allows, not narrow it.
_SCHEMA_VALUES = ("items", "additionalItems", "contains", "then", "else", "unevaluatedItems")
_BRANCHES = ("anyOf", "oneOf", "allOf")
_OPEN_KEYS = ("additionalProperties", "unevaluatedProperties")


def strict_json_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``schema`` in which every object schema without ``additionalProperties`` (or
    ``unevaluatedProperties``) has ``additionalProperties: false``: in nested objects, array items,
    ``anyOf``/``oneOf``/``allOf`` branches and ``$defs``/``definitions``. An explicit value is kept.

    An object whose properties come partly from its ``allOf``/``anyOf``/``oneOf`` branches is closed at its
    own level over the union of the names they declare, and the branches stay open: closing each branch
    would forbid the keys the others declare.
    """
    schema = copy.deepcopy(schema)
    _close(schema, schema, open_here=False)
    return schema


def _is_object(node: dict[str, Any]) -> bool:
    kind = node.get("type")
    if isinstance(kind, list):
        return "object" in kind
    return kind == "object" or (kind is None and "properties" in node)


def _close(node: Any, root: dict[str, Any], open_here: bool) -> None:
    if not isinstance(node, dict):
        return
    branches = [branch for key in _BRANCHES for branch in node.get(key, []) if isinstance(branch, dict)]
    object_branches = [branch for branch in branches if _is_object(_resolved(branch, root))]
    # allOf refines the object it sits in, as do anyOf/oneOf inside a declared object.
    composite = bool(object_branches) and (_is_object(node) or any(
        isinstance(branch, dict) and _is_object(_resolved(branch, root)) for branch in node.get("allOf", [])))
    if (_is_object(node) or composite) and not open_here and not any(key in node for key in _OPEN_KEYS):
        if composite:
            properties = node.setdefault("properties", {})
            for branch in object_branches:
                for name in _resolved(branch, root).get("properties", {}):
                    properties.setdefault(name, {})  # declared by a branch, which says what it holds
        node["additionalProperties"] = False
    for key in _SCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            for value in node[key].values():
                _close(value, root, open_here=False)
    for key in _SCHEMA_LISTS:
        if isinstance(node.get(key), list):
            for value in node[key]:
                _close(value, root, open_here=False)
    for key in _SCHEMA_VALUES + ("additionalProperties", "unevaluatedProperties"):
        value = node.get(key)
        if isinstance(value, list):  # draft 4's tuple form of items
            for item in value:
                _close(item, root, open_here=False)
        else:
            _close(value, root, open_here=False)
    for branch in branches:
        _close(branch, root, open_here=composite)


def _resolved(node: dict[str, Any], root: dict[str, Any]) -> dict[str, Any]:
    """``node``, or the local definition its ``$ref`` names (``#/$defs/X``, ``#/definitions/X``)."""
    ref = node.get("$ref")
    if isinstance(ref, str):
        match = re.fullmatch(r"#/(\$defs|definitions)/([^/]+)", ref)
        if match:
            target = root.get(match.group(1), {}).get(match.group(2))
            if isinstance(target, dict):
                return target
    return node
