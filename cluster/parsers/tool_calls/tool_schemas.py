"""The tools offered to the model, reduced to what parsers need: each function's parameter
schemas (formats that write raw parameter values use them to type the values)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any


def function_of(tool: dict[str, Any] | str, field: str = "tools") -> dict[str, Any]:
    """The function definition inside an OpenAI tool ({"type": "function", "function": {...}})
    or a bare function definition ({"name", "description", "parameters"}); JSON text allowed."""
    if isinstance(tool, str):
        try:
            tool = json.loads(tool)
        except ValueError as exc:
            raise ValueError(f"{field}: not valid JSON: {exc}") from None
    if not isinstance(tool, dict):
        raise ValueError(f"{field}: a tool must be a JSON object, got {type(tool).__name__}")
    function = tool.get("function", tool) if tool.get("type", "function") == "function" else tool
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ValueError(f"{field}: a tool needs a function with a string name")
    return function


class ToolSchemas:
    """Name -> parameters JSON schema of each offered function."""

    def __init__(self, tools: Sequence[dict[str, Any] | str] | None = None) -> None:
        self._parameters: dict[str, dict[str, Any]] = {}
        for i, tool in enumerate(tools or ()):
            function = function_of(tool, f"tools[{i}]")
            parameters = function.get("parameters") or {}
            if not isinstance(parameters, dict):
                raise ValueError(f"tools[{i}].parameters must be a JSON object")
            self._parameters[function["name"]] = parameters

    def names(self) -> list[str]:
        return list(self._parameters)

    def parameter_schema(self, function: str, parameter: str) -> dict[str, Any] | None:
        """The schema of one parameter, or None when the function or parameter is unknown."""
        properties = self._parameters.get(function, {}).get("properties")
        if not isinstance(properties, dict):
            return None
        schema = properties.get(parameter)
        return schema if isinstance(schema, dict) else None
