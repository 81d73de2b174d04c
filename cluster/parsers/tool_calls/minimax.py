"""MiniMax-M1 / MiniMax-Text-01 tool calls (hybrid lightning-attention models): one block
of JSON call objects, one per line, as the model's chat template asks for,

    <tool_calls>
    {"name": "search_web", "arguments": {"query_list": ["OpenAI"]}}
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_calls>

Each object is read as json_call_object says. Whitespace between the objects is layout;
an object that is no call, and other text in the block, is content; a block with no call
in it is content, tags included.
"""

from __future__ import annotations

from kvloom.cluster.parsers.tool_calls.base import ToolCallParser

START = "<tool_calls>"
END = "</tool_calls>"
_WHITESPACE = " \t\r\n"


class MiniMaxToolParser(ToolCallParser):
    name = "minimax"
    start_markers = (START,)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._state = "content"
        self._raw: list[str] | None = None  # the block's text while it has no call
        self._block_has_call = False
        self._reader = self._call_object_reader()

    def _step(self) -> bool:
        return getattr(self, "_state_" + self._state)()

    def _state_content(self) -> bool:
        text, marker = self._take_until((START,))
        self._emit_content(text)
        if marker is None:
            return False
        self._raw, self._block_has_call = [marker], False
        self._state = "block"
        return True

    def _as_content(self, text: str) -> None:
        """Text in the block that is no call; the first such text also gives the block's
        opening back, when no call came before it."""
        if self._raw is not None and not self._block_has_call:
            text = "".join(self._raw) + text
        self._raw = None
        self._emit_content(text)

    def _state_block(self) -> bool:
        text, marker = self._take_until(("{", END))
        if text.strip(_WHITESPACE):
            self._as_content(text)
        elif self._raw is not None and not self._block_has_call:
            self._raw.append(text)
        else:
            self._emit_content(text)  # (held: dropped before a call or at the block's end)
        if marker is None:
            return False
        if marker == "{":
            self._buf = marker + self._buf
            self._reader = self._call_object_reader()
            self._state = "object"
            return True
        if self._block_has_call:
            self._drop_pending_whitespace()
        else:
            self._as_content(marker)
        self._raw = None
        self._state = "content"
        return True

    def _state_object(self) -> bool:
        reader = self._reader
        if not self._feed_call_object(reader):
            return False
        if reader.committed:
            self._raw, self._block_has_call = None, True
            self._close_call()
        else:
            self._as_content(reader.consumed)
        self._state = "block"
        return True

    def _at_eof(self) -> None:
        if self._raw is not None and not self._block_has_call:
            self._emit_content("".join(self._raw))
            self._raw = None
