"""One request's chat output parsing: reasoning first, then tool calls in the content that
remains (so `</think><tool_call>` in one delta splits correctly)."""

from __future__ import annotations

from kvloom.cluster.parsers.deltas import Delta, DeltaBuilder
from kvloom.cluster.parsers.reasoning.tag_reasoning import TagReasoningParser
from kvloom.cluster.parsers.tool_calls.base import ToolCallParser


class ChatOutputParser:
    """Either part may be None: no reasoning parsing, or no tool-call parsing."""

    def __init__(
        self,
        reasoning: TagReasoningParser | None = None,
        tool_calls: ToolCallParser | None = None,
    ) -> None:
        self.reasoning = reasoning
        self.tool_calls = tool_calls

    @property
    def num_tool_calls(self) -> int:
        return 0 if self.tool_calls is None else self.tool_calls.num_tool_calls

    def feed(self, text: str) -> list[Delta]:
        if self.reasoning is None:
            return self._content(text, end=False)
        reasoning, content = self.reasoning.feed(text)
        return self._merge(reasoning, self._content(content, end=False))

    def finish(self) -> list[Delta]:
        if self.reasoning is None:
            return self._content("", end=True)
        reasoning, content = self.reasoning.finish()
        return self._merge(reasoning, self._content(content, end=True))

    def _content(self, text: str, end: bool) -> list[Delta]:
        if self.tool_calls is None:
            return [Delta(content=text)] if text else []
        deltas = self.tool_calls.feed(text) if text else []
        return deltas + self.tool_calls.finish() if end else deltas

    @staticmethod
    def _merge(reasoning: str, deltas: list[Delta]) -> list[Delta]:
        out = DeltaBuilder()
        out.reasoning(reasoning)
        out.extend(deltas)
        return out.take()
