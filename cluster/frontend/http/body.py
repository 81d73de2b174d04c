"""A request body as JSON, decoded here rather than by the framework, so that hostile bytes
get a 400 naming what is wrong: invalid UTF-8, a lone surrogate (valid JSON, `"\\ud800"`,
but no text), nesting too deep, or no JSON at all.

Depth counts the whole body, which wraps the deepest field the gRPC checks limit
(`tools[i].function.parameters`) in OUTER_LEVELS levels: the body is allowed that many more
than `limits.max_json_depth`, so those checks, naming the field, decide what a field may
hold."""

from __future__ import annotations

import json
from typing import Any

from kvloom.cluster.frontend.errors import InvalidArgument

OUTER_LEVELS = 4  # body {tools [ {function {parameters


def _path(parent: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{parent}[{key}]"
    return f"{parent}.{key}" if parent else key


def _check_text(where: str, text: str) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidArgument(
            where or "body",
            f"not valid Unicode (a lone surrogate at character {exc.start})",
        ) from None


def check_tree(value: Any, max_depth: int, where: str = "", depth: int = 1) -> None:
    """Walks a decoded document: the depth of every object and array (the body is 1), the
    text of every key and string."""
    if isinstance(value, str):
        _check_text(where, value)
        return
    if not isinstance(value, dict | list):
        return
    if depth > max_depth:
        raise InvalidArgument(where or "body", f"JSON nested deeper than {max_depth} levels")
    if isinstance(value, dict):
        for key, item in value.items():
            _check_text(where, key)
            check_tree(item, max_depth, _path(where, key), depth + 1)
    else:
        for i, item in enumerate(value):
            check_tree(item, max_depth, _path(where, i), depth + 1)


def decode_json_object(raw: bytes, max_field_depth: int) -> dict[str, Any]:
    """The body as a JSON object; `max_field_depth` is the server's limits.max_json_depth."""
    max_depth = max_field_depth + OUTER_LEVELS
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidArgument("body", f"not valid UTF-8 (byte {exc.start})") from None
    try:
        value = json.loads(text)
    except RecursionError:
        raise InvalidArgument("body", f"JSON nested deeper than {max_depth} levels") from None
    except ValueError as exc:
        raise InvalidArgument("body", f"not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise InvalidArgument("body", f"must be a JSON object, got {type(value).__name__}")
    check_tree(value, max_depth)
    return value
