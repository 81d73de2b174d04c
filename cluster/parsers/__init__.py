"""Streaming parsers for generated text: tool calls (one module per model format) and
reasoning, chosen by name or model type (registry), combined per request (ChatOutputParser).
"""

from kvloom.cluster.parsers.chat_output import ChatOutputParser
from kvloom.cluster.parsers.deltas import Delta, ParsedMessage, ToolCall, ToolCallDelta, collect
from kvloom.cluster.parsers.registry import (
    make_reasoning_parser,
    make_tool_call_parser,
    parsers_for_model,
    reasoning_parser_class,
    tool_call_parser_class,
)

__all__ = [
    "ChatOutputParser",
    "Delta",
    "ParsedMessage",
    "ToolCall",
    "ToolCallDelta",
    "collect",
    "make_reasoning_parser",
    "make_tool_call_parser",
    "parsers_for_model",
    "reasoning_parser_class",
    "tool_call_parser_class",
]
