"""Choosing parsers by name (a server flag) or by the model's type."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvloom.cluster.parsers.reasoning.tag_reasoning import (
    KimiReasoningParser,
    TagReasoningParser,
    ThinkReasoningParser,
)
from kvloom.cluster.parsers.tool_calls.base import CallIdFactory, ToolCallParser
from kvloom.cluster.parsers.tool_calls.deepseek_v3 import DeepSeekV3ToolParser
from kvloom.cluster.parsers.tool_calls.hermes import HermesToolParser
from kvloom.cluster.parsers.tool_calls.kimi_k2 import KimiK2ToolParser
from kvloom.cluster.parsers.tool_calls.llama3_json import Llama3JsonToolParser
from kvloom.cluster.parsers.tool_calls.minimax import MiniMaxToolParser
from kvloom.cluster.parsers.tool_calls.mistral import MistralToolParser
from kvloom.cluster.parsers.tool_calls.qwen3_coder import Qwen3CoderToolParser

TOOL_CALL_PARSERS: dict[str, type[ToolCallParser]] = {
    "hermes": HermesToolParser,
    "qwen3_coder": Qwen3CoderToolParser,
    "kimi_k2": KimiK2ToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "deepseek_v3": DeepSeekV3ToolParser,
    "minimax": MiniMaxToolParser,
}
TOOL_CALL_PARSER_ALIASES = {
    "qwen": "hermes",
    "qwen3_xml": "qwen3_coder",
    "kimi": "kimi_k2",
    "llama3": "llama3_json",
    "deepseek_v31": "deepseek_v3",
    "minimax_m1": "minimax",
}
REASONING_PARSERS: dict[str, type[TagReasoningParser]] = {
    "think": ThinkReasoningParser,
    "kimi": KimiReasoningParser,
}
REASONING_PARSER_ALIASES = {
    "qwen3": "think",
    "deepseek_r1": "think",
    "kimi_k2": "kimi",
}

# config.json model_type -> parser names (tool calls, reasoning).
_BY_MODEL_TYPE: dict[str, tuple[str | None, str | None]] = {
    "qwen2": ("hermes", None),
    "qwen2_moe": ("hermes", None),
    "qwen3": ("hermes", "think"),
    "qwen3_moe": ("hermes", "think"),
    "qwen3_next": ("hermes", "think"),
    "qwen3_5": ("qwen3_coder", "think"),
    "qwen3_5_moe": ("qwen3_coder", "think"),
    "kimi_k2": ("kimi_k2", "kimi"),
    "kimi_linear": ("kimi_k2", "kimi"),
    "llama": ("llama3_json", None),
    "mistral": ("mistral", None),
    "mixtral": ("mistral", None),
    "deepseek_v3": ("deepseek_v3", "think"),
    # MiniMax-Text-01 and -M1: hybrid lightning (linear) attention.
    "minimax_text_01": ("minimax", None),
    "minimax_m1": ("minimax", "think"),
}


def _resolve(kind: str, name: str, table: dict, aliases: dict[str, str]) -> Any:
    key = aliases.get(name, name)
    if key not in table:
        choices = ", ".join(sorted({*table, *aliases}))
        raise ValueError(f"{kind}: unknown parser {name!r}; choose one of: {choices}")
    return table[key]


def tool_call_parser_class(name: str) -> type[ToolCallParser]:
    return _resolve("tool_call_parser", name, TOOL_CALL_PARSERS, TOOL_CALL_PARSER_ALIASES)


def reasoning_parser_class(name: str) -> type[TagReasoningParser]:
    return _resolve("reasoning_parser", name, REASONING_PARSERS, REASONING_PARSER_ALIASES)


def make_tool_call_parser(
    name: str,
    tools: Sequence[dict[str, Any] | str] | None = None,
    call_id_factory: CallIdFactory | None = None,
) -> ToolCallParser:
    return tool_call_parser_class(name)(tools=tools, call_id_factory=call_id_factory)


def make_reasoning_parser(name: str, start_in_reasoning: bool = False) -> TagReasoningParser:
    return reasoning_parser_class(name)(start_in_reasoning=start_in_reasoning)


def parsers_for_model(model_type: str, model_name: str = "") -> tuple[str | None, str | None]:
    """Default (tool-call parser, reasoning parser) names for a model, or None where there is
    no known format. `model_name` (the path or hub id) separates checkpoints that share a
    model_type: Qwen3-Coder writes XML calls, Kimi-K2 ships as deepseek_v3."""
    lowered = model_name.lower()
    if "kimi" in lowered:
        return "kimi_k2", "kimi"
    tools, reasoning = _BY_MODEL_TYPE.get(model_type, (None, None))
    if model_type.startswith("qwen3") and "coder" in lowered:
        tools = "qwen3_coder"
    return tools, reasoning
