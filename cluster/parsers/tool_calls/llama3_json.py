"""Llama 3.1+ JSON tool calls: the whole output is calls, optionally after `<|python_tag|>`,

    {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", ...}

separated by `;`. Only output that starts (after whitespace) with `{` or the python tag is
read as calls; anything else is content. If the first object turns out not to be a call
(other keys, no name), the text is given back as content.
"""

from __future__ import annotations

from kvloom.cluster.parsers.tool_calls.base import ToolCallParser
from kvloom.cluster.parsers.tool_calls.json_call_object import JsonCallObjectReader

PYTHON_TAG = "<|python_tag|>"
SEPARATOR = ";"
_TOLERATED_KEYS = ("type",)  # {"type": "function", "name": ...} also occurs
_WHITESPACE = " \t\r\n"


class Llama3JsonToolParser(ToolCallParser):
    name = "llama3_json"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._state = "start"
        self._held: list[str] = []  # text read before the first call is certain
        self._reader = JsonCallObjectReader(_TOLERATED_KEYS)

    def _step(self) -> bool:
        return getattr(self, "_state_" + self._state)()

    def _as_content(self) -> bool:
        """Not calls after all: everything held, and all that follows, is content."""
        self._emit_content("".join(self._held))
        self._held = []
        self._state = "content"
        return True

    def _state_content(self) -> bool:
        text = self._consume(len(self._buf))
        self._emit_content(text)
        return False

    def _state_start(self) -> bool:
        stripped = self._buf.lstrip(_WHITESPACE)
        if not stripped:
            return self._as_content() if self._eof else False
        if stripped.startswith(PYTHON_TAG):
            self._held.append(self._consume(len(self._buf) - len(stripped) + len(PYTHON_TAG)))
            self._state = "expect_object"
        elif stripped.startswith("{"):
            self._held.append(self._consume(len(self._buf) - len(stripped)))
            self._state = "expect_object"
        elif PYTHON_TAG.startswith(stripped) and not self._eof:
            return False
        else:
            return self._as_content()
        return True

    def _state_expect_object(self) -> bool:
        stripped = self._buf.lstrip(_WHITESPACE)
        if not stripped:
            if self._eof and self._num_calls == 0:
                return self._as_content()
            return False
        if stripped[0] != "{":
            if self._num_calls == 0:
                return self._as_content()
            self._state = "content"
            return True
        lead = self._consume(len(self._buf) - len(stripped))
        if self._num_calls == 0:
            self._held.append(lead)
        self._reader = JsonCallObjectReader(_TOLERATED_KEYS)
        self._state = "object"
        return True

    def _state_object(self) -> bool:
        reader = self._reader
        if not self._feed_call_object(reader):
            return False
        if reader.name is None:
            if self._num_calls == 0:  # the first object was not a call: all of it is content
                self._held.append(reader.consumed)
                return self._as_content()
            self._emit_content(reader.consumed)
            self._state = "content"
            return True
        self._held = []  # committed: this was a call
        self._close_call()
        self._state = "after_object" if reader.done else "content"
        return True

    def _state_after_object(self) -> bool:
        if not self._skip_whitespace():
            return False
        if self._buf[0] == SEPARATOR:
            self._consume(1)
            self._state = "expect_object"
        elif self._buf[0] == "{":
            self._state = "expect_object"
        else:
            self._state = "content"
        return True
