"""Llama 3.1+ JSON tool calls, optionally after `<|python_tag|>`,

    {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", ...}

separated by `;`. The calls carry no markers, so a JSON object counts as a call only when
(docs/parsers.md): it is a call object (a `name` that resolves to an offered tool, object
`parameters`/`arguments`, optionally `"type": "function"` first), and what follows it is the
end of the output, `;` or the next object. Prose may come before the calls (it is content);
an object followed by more prose (`{"name": "x"} is the key`) is content, as is any object
that is not a call. A call is therefore sent once its object has closed and the next
character is known, not while its arguments are written.
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
    start_markers = (PYTHON_TAG,)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._state = "content"
        self._held: list[str] = []  # the text of a possible call, content if it is not one
        self._reader = self._lazy_reader()

    def _lazy_reader(self) -> JsonCallObjectReader:
        return self._call_object_reader(_TOLERATED_KEYS, eager=False)

    def _step(self) -> bool:
        return getattr(self, "_state_" + self._state)()

    def _give_back(self) -> bool:
        """Not a call after all: what was held is content."""
        self._emit_content("".join(self._held))
        self._held = []
        self._state = "content"
        return True

    def _state_content(self) -> bool:
        brace = self._buf.find("{")
        tag = self._buf.find(PYTHON_TAG)
        if tag >= 0 and (brace < 0 or tag < brace):
            self._emit_content(self._consume(tag))
            self._held = [self._consume(len(PYTHON_TAG))]
            self._state = "after_tag"
            return True
        if brace >= 0:
            self._emit_content(self._consume(brace))
            self._held = []
            self._open_object()
            return True
        text, _ = self._take_until((PYTHON_TAG,))
        self._emit_content(text)
        return False

    def _open_object(self) -> None:
        self._reader = self._lazy_reader()
        self._state = "object"

    def _state_after_tag(self) -> bool:
        stripped = self._buf.lstrip(_WHITESPACE)
        if not stripped:
            if self._eof:
                return self._give_back()
            return False
        self._held.append(self._consume(len(self._buf) - len(stripped)))
        if stripped[0] != "{":
            return self._give_back()
        self._open_object()
        return True

    def _state_object(self) -> bool:
        reader = self._reader
        if not self._feed_call_object(reader):
            return False
        self._held.append(reader.consumed)
        if not reader.done or reader.name is None:
            return self._give_back()
        self._state = "after_object"
        return True

    def _state_after_object(self) -> bool:
        """A complete call object: a call if the output ends, or `;` or `{` follows."""
        stripped = self._buf.lstrip(_WHITESPACE)
        if not stripped and not self._eof:
            return False
        if stripped and stripped[0] not in (SEPARATOR, "{"):
            return self._give_back()
        reader = self._reader
        assert reader.name is not None
        self._held = []
        self._start_call(reader.name)
        self._emit_arguments(reader.arguments or "")
        self._close_call()
        self._buf = stripped
        if stripped and stripped[0] == SEPARATOR:
            self._consume(1)
        self._state = "between_calls"
        return True

    def _state_between_calls(self) -> bool:
        if not self._skip_whitespace():
            return False
        if self._buf[0] == "{":
            self._open_object()
        else:
            self._state = "content"
        return True
