"""One request's chat output parsing: reasoning first, then tool calls in the content that
remains (so `</think><tool_call>` in one delta splits correctly).

The tool-call format's start markers also end an open reasoning block (a call written while
thinking is a call). The block's own end tag, when it comes after such a call, is dropped from
the content: the block was already closed (docs/parsers.md).
"""

from __future__ import annotations

from kvloom.cluster.parsers.deltas import Delta, DeltaBuilder
from kvloom.cluster.parsers.markers import find_first_marker, partial_marker_len
from kvloom.cluster.parsers.reasoning.tag_reasoning import TagReasoningParser
from kvloom.cluster.parsers.tool_calls.base import ToolCallParser


class _DropFirstTag:
    """Removes the first occurrence of any of `tags` from a stream of content pieces."""

    def __init__(self, tags: tuple[str, ...]) -> None:
        self._tags = tags
        self._held = ""
        self.active = False

    def content(self, text: str) -> str:
        if not self.active:
            return text
        text = self._held + text
        pos, tag = find_first_marker(text, self._tags)
        if tag is not None:
            self.active, self._held = False, ""
            return text[:pos] + text[pos + len(tag) :]
        keep = partial_marker_len(text, self._tags)
        self._held = text[len(text) - keep :]
        return text[: len(text) - keep]

    def flush(self) -> str:
        """Other output follows (or the stream ended): what was held was no tag."""
        held, self._held = self._held, ""
        return held


class ChatOutputParser:
    """Either part may be None: no reasoning parsing, or no tool-call parsing."""

    def __init__(
        self,
        reasoning: TagReasoningParser | None = None,
        tool_calls: ToolCallParser | None = None,
    ) -> None:
        self.reasoning = reasoning
        self.tool_calls = tool_calls
        self._stray_end_tag = _DropFirstTag(reasoning.end_tags if reasoning else ())
        self._armed = False
        if reasoning is not None and tool_calls is not None:
            reasoning.end_also_at(tool_calls.start_markers)

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
        if end:
            deltas += self.tool_calls.finish()
        if self.reasoning is not None and self.reasoning.ended_implicitly:
            if not self._armed:  # from here on, the first end tag in the content goes
                self._armed = self._stray_end_tag.active = True
            deltas = self._drop_stray_end_tag(deltas, end)
        return deltas

    def _drop_stray_end_tag(self, deltas: list[Delta], end: bool) -> list[Delta]:
        out = DeltaBuilder()
        drop = self._stray_end_tag
        for delta in deltas:
            if delta.content:
                out.content(drop.content(delta.content))
            if delta.reasoning or delta.tool_calls:
                out.content(drop.flush())
                out.extend([Delta(reasoning=delta.reasoning, tool_calls=delta.tool_calls)])
        if end:
            out.content(drop.flush())
        return out.take()

    @staticmethod
    def _merge(reasoning: str, deltas: list[Delta]) -> list[Delta]:
        out = DeltaBuilder()
        out.reasoning(reasoning)
        out.extend(deltas)
        return out.take()
