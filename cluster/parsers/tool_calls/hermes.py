"""Hermes / Qwen2.5 / Qwen3 tool calls:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block per call. The JSON is read with string awareness, so `</tool_call>` inside an
argument string is argument text. A block whose body is not a call object (see
json_call_object for what is) is given back as content; text after a call object that is
not the end tag ends the call and is content.
"""

from __future__ import annotations

from kvloom.cluster.parsers.tool_calls.base import ToolCallParser

START = "<tool_call>"
END = "</tool_call>"


class HermesToolParser(ToolCallParser):
    name = "hermes"
    start_markers = (START,)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._state = "content"
        self._reader = self._call_object_reader()

    def _open_block(self) -> None:
        self._reader = self._call_object_reader()
        self._state = "object"

    def _step(self) -> bool:
        state = self._state
        if state == "content":
            text, marker = self._take_until((START,))
            self._emit_content(text)
            if marker is None:
                return False
            self._open_block()
            return True
        if state == "object":
            return self._read_object()
        if state == "after_object":
            return self._after_object()
        # "skip": a call whose JSON broke after its name; drop the rest of the block
        _, marker = self._take_until((END,))
        if marker is None:
            return False
        self._close_call()
        self._state = "content"
        return True

    def _after_object(self) -> bool:
        """Expects the end tag. A stray closing brace (a common slip) is dropped; other text
        means the model left the block without closing it: the call ends, the text is content."""
        stripped = self._buf.lstrip(" \t\r\n}]")
        self._consume(len(self._buf) - len(stripped))
        if not stripped:
            return False
        marker = self._starts_with((END, START))
        if marker == "":
            return False
        self._close_call()
        if marker == START:
            self._consume(len(START))
            self._open_block()
            return True
        if marker == END:
            self._consume(len(END))
        self._state = "content"
        return True

    def _read_object(self) -> bool:
        reader = self._reader
        if not self._feed_call_object(reader):
            return False
        if not reader.committed:  # not a tool call after all: the block is content
            self._emit_content(START + reader.consumed)
            self._state = "content"
        else:
            self._state = "after_object" if reader.done else "skip"
        return True
