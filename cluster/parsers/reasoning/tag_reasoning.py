"""Reasoning parsers for models that wrap their reasoning in tags: `<think>…</think>`
(Qwen3, DeepSeek-R1 and most others) and Kimi's `◁think▷…◁/think▷`.

`feed(text)` returns (reasoning, content) deltas; `finish()` flushes what was held back (a
possible partial tag). The reasoning block must come first: a start tag counts only before
any content, so a later literal "<think>" in an answer stays content.

Many templates open the reasoning block in the prompt (DeepSeek-R1, Qwen3-thinking), so
the output starts inside it with no start tag; pass `start_in_reasoning=True` then
(`prompt_opens_reasoning(prompt)` tells). A start tag the model repeats anyway is dropped.
With `enable_thinking=False`, Qwen3 templates close an empty block in the prompt, and the
output is all content.

A tool-call marker ends an open reasoning block (docs/parsers.md): models that call a tool
mid-thought often never close the block, and the call must not be lost in the reasoning.
`end_also_at(markers)` adds the markers of the request's tool-call format (ChatOutputParser
does this); the marker stays in the text, for the tool-call parser.
"""

from __future__ import annotations

from typing import ClassVar

from kvloom.cluster.parsers.markers import find_first_marker, is_proper_prefix, partial_marker_len

_WHITESPACE = " \t\r\n"


class TagReasoningParser:
    name: ClassVar[str] = "think"
    start_tags: ClassVar[tuple[str, ...]] = ("<think>",)
    end_tags: ClassVar[tuple[str, ...]] = ("</think>",)
    # Markers that end reasoning without an end tag; they stay in the text, for the tool parser.
    implicit_ends: ClassVar[tuple[str, ...]] = ()

    def __init__(self, start_in_reasoning: bool = False) -> None:
        self._buf = ""
        self._state = "open_reasoning" if start_in_reasoning else "start"
        self._finished = False
        self._implicit_ends = self.implicit_ends
        self.ended_implicitly = False  # reasoning ended at a tool-call marker, not an end tag

    def end_also_at(self, markers: tuple[str, ...]) -> None:
        """Markers that also end reasoning (a tool-call format's start markers)."""
        extra = tuple(m for m in markers if m and m not in self._implicit_ends)
        self._implicit_ends = self._implicit_ends + extra

    @classmethod
    def prompt_opens_reasoning(cls, prompt: str) -> bool:
        """Whether the prompt ends inside a reasoning block (its last start tag is after its
        last end tag), so generation starts in reasoning."""
        last_start = max((prompt.rfind(t) for t in cls.start_tags), default=-1)
        last_end = max((prompt.rfind(t) for t in cls.end_tags), default=-1)
        return last_start > last_end

    @property
    def in_reasoning(self) -> bool:
        return self._state in ("open_reasoning", "reasoning")

    def feed(self, text: str) -> tuple[str, str]:
        if self._finished:
            raise RuntimeError("feed() after finish()")
        self._buf += text
        return self._drain(eof=False)

    def finish(self) -> tuple[str, str]:
        if self._finished:
            return "", ""
        result = self._drain(eof=True)
        self._finished = True
        return result

    def _drain(self, eof: bool) -> tuple[str, str]:
        reasoning: list[str] = []
        content: list[str] = []
        while self._buf:
            if self._state in ("start", "open_reasoning"):
                if not self._leading_tag(eof, reasoning, content):
                    break
            elif self._state == "reasoning":
                stops = self.end_tags + self._implicit_ends
                pos, marker = find_first_marker(self._buf, stops)
                if marker is None:
                    keep = 0 if eof else partial_marker_len(self._buf, stops)
                    reasoning.append(self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep :]
                    break
                reasoning.append(self._buf[:pos])
                skip = len(marker) if marker in self.end_tags else 0
                self.ended_implicitly = skip == 0
                self._buf = self._buf[pos + skip :]
                self._state = "content"
            else:
                content.append(self._buf)
                self._buf = ""
        return "".join(reasoning), "".join(content)

    def _leading_tag(self, eof: bool, reasoning: list[str], content: list[str]) -> bool:
        """Before any text: look for a start tag. Returns False to wait for more text."""
        opened = self._state == "open_reasoning"
        stripped = self._buf.lstrip(_WHITESPACE)
        tag = next((t for t in self.start_tags if stripped.startswith(t)), None)
        if tag is not None:
            self._buf = stripped[len(tag) :]
            self._state = "reasoning"
            return True
        if not eof and (not stripped or is_proper_prefix(stripped, self.start_tags)):
            return False
        self._state = "reasoning" if opened else "content"
        return True


class ThinkReasoningParser(TagReasoningParser):
    """`<think>…</think>`: Qwen3, Qwen3.5, DeepSeek-R1, and others."""


class KimiReasoningParser(TagReasoningParser):
    """Kimi: `◁think▷…◁/think▷` (Kimi-VL, K1.5) or `<think>…</think>` (K2-thinking); reasoning
    also ends where a tool-call section begins."""

    name = "kimi"
    start_tags = ("◁think▷", "<think>")
    end_tags = ("◁/think▷", "</think>")
    implicit_ends = ("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>")
