"""Typing raw parameter values (XML-style formats write `3`, `true`, `[1, 2]` or free text)
by the tool's JSON schema, for the JSON arguments handed to clients."""

from __future__ import annotations

import ast
import json
import math
from typing import Any

# Type names clients write in tool schemas besides JSON Schema's own (Python's, C's, OpenAPI's).
_TYPE_ALIASES = {
    "int": "integer", "long": "integer", "uint": "integer",
    "float": "number", "double": "number", "decimal": "number",
    "bool": "boolean", "str": "string", "text": "string",
    "dict": "object", "map": "object", "list": "array", "tuple": "array",
    "none": "null", "nonetype": "null",
}  # fmt: skip
_NULL_WORDS = ("null", "None", "NULL", "Null")


def _schema_types(schema: dict[str, Any] | None) -> list[str]:
    if not schema:
        return []
    declared = schema.get("type")
    types = [declared] if isinstance(declared, str) else list(declared or [])
    types = [_TYPE_ALIASES.get(t.lower(), t.lower()) if isinstance(t, str) else t for t in types]
    if schema.get("nullable") is True:  # OpenAPI 3.0's way of saying ["...", "null"]
        types.append("null")
    for key in ("anyOf", "oneOf"):
        for option in schema.get(key) or []:
            if isinstance(option, dict):
                types += _schema_types(option)
    if not types and "enum" in schema:
        types = sorted({_json_type(v) for v in schema["enum"]})
    if not types and "properties" in schema:
        types = ["object"]
    return [t for t in types if isinstance(t, str)]


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if value is None:
        return "null"
    return "string" if isinstance(value, str) else "object"


def _convert(raw: str, json_type: str) -> tuple[bool, Any]:
    text = raw.strip()
    if json_type == "null":  # `None` too: models trained on Python write it
        return text in _NULL_WORDS, None
    if json_type == "boolean":
        lowered = text.lower()
        return lowered in ("true", "false"), lowered == "true"
    if json_type in ("integer", "number"):
        try:
            value = json.loads(text)
        except ValueError:
            try:
                value = float(text)
            except ValueError:
                return False, None
        if isinstance(value, bool) or not isinstance(value, int | float):
            return False, None
        if isinstance(value, float) and not math.isfinite(value):
            return False, None
        if json_type == "integer":
            if isinstance(value, float) and not value.is_integer():
                return False, None
            return True, int(value)
        return True, value
    if json_type in ("object", "array"):
        expected = dict if json_type == "object" else list
        try:
            value = json.loads(text)
        except ValueError:
            try:  # models sometimes write Python literals ({'a': True})
                value = ast.literal_eval(text)
            except (ValueError, SyntaxError, MemoryError, RecursionError):
                return False, None
        return isinstance(value, expected), value
    return False, None


def parameter_json(raw: str, schema: dict[str, Any] | None) -> str:
    """The JSON text for one raw value: typed by the schema when it converts cleanly, else
    the raw text as a JSON string (also for parameters the schema does not know). A schema
    that allows strings keeps the text a string, except `null` where null is allowed."""
    types = _schema_types(schema)
    candidates = ["null"] if "null" in types else []
    if "string" not in types:
        candidates += [t for t in types if t != "null"]
    for json_type in candidates:
        ok, value = _convert(raw, json_type)
        if ok:
            try:
                return json.dumps(value, ensure_ascii=False, allow_nan=False)
            except ValueError:  # NaN/inf inside a literal
                continue
    return json.dumps(raw, ensure_ascii=False)
