"""Qwen3-Coder / Qwen3.5 XML tool calls:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

Values are raw text, typed by the tool's JSON schema (see parameter_values). The arguments
stream as a JSON object: `{` when the function opens, one `"key": value` fragment per
parameter as it closes, `}` when the function closes. The rules (docs/parsers.md):

- XML has no escaping, so a `</parameter>` counts as the end of a value only when the next
  thing is another parameter, the end of the function or call, or the end of the stream
  (possibly cut inside such a tag); otherwise it is value text;
- a value whose `</parameter>` is missing ends at the next `<parameter=`, `</function>` or
  `</tool_call>`;
- a parameter written twice keeps its first value (later ones are dropped: the first was
  already sent);
- the function name resolves against the offered tools (tool_names); one that does not is
  no call, and its text is content.
"""

from __future__ import annotations

import json
import re

from kvloom.cluster.parsers.markers import is_proper_prefix
from kvloom.cluster.parsers.tool_calls.base import ToolCallParser
from kvloom.cluster.parsers.tool_calls.parameter_values import parameter_json

TOOL_CALL = "<tool_call>"
END_TOOL_CALL = "</tool_call>"
FUNCTION = "<function="
END_FUNCTION = "</function>"
PARAMETER = "<parameter="
END_PARAMETER = "</parameter>"
# What may follow a real </parameter>, and what ends a value whose </parameter> is missing.
_AFTER_PARAMETER = (PARAMETER, END_FUNCTION, END_TOOL_CALL)
_MAX_NAME = 256
_NAME = re.compile(r"\s*[\w.\-:]*\s*")
_WHITESPACE = " \t\r\n"


def _strip_one_newline(value: str) -> str:
    """The template puts the value on its own lines; those two newlines are layout."""
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


class Qwen3CoderToolParser(ToolCallParser):
    name = "qwen3_coder"
    start_markers = (TOOL_CALL,)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._state = "content"
        self._raw: list[str] = []  # text of a block before its function is known (fallback)
        self._function = ""
        self._parameter = ""
        self._num_parameters = 0
        self._seen_parameters: set[str] = set()
        self._scan_from = 0
        self._tag_from = 0

    def _step(self) -> bool:
        return getattr(self, "_state_" + self._state)()

    def _give_back(self) -> bool:
        """What looked like a call is not one: its text is content."""
        self._emit_content("".join(self._raw))
        self._raw = []
        self._state = "content"
        return True

    def _state_content(self) -> bool:
        text, marker = self._take_until((TOOL_CALL, FUNCTION))
        self._emit_content(text)
        if marker is None:
            return False
        self._raw = [marker]
        self._state = "block" if marker == TOOL_CALL else "function_name"
        return True

    def _state_block(self) -> bool:
        stripped = self._buf.lstrip(_WHITESPACE)
        if not stripped:
            if self._eof:
                return self._give_back()
            return False
        lead = len(self._buf) - len(stripped)
        self._raw.append(self._consume(lead))
        if self._buf.startswith(FUNCTION):
            self._raw.append(self._consume(len(FUNCTION)))
            self._state = "function_name"
        elif self._buf.startswith(END_TOOL_CALL):  # an empty block
            self._consume(len(END_TOOL_CALL))
            self._raw = []
            self._state = "content"
        elif not self._eof and is_proper_prefix(self._buf, (FUNCTION, END_TOOL_CALL)):
            return False
        else:
            return self._give_back()
        return True

    def _state_function_name(self) -> bool:
        end = self._buf.find(">")
        candidate = self._buf if end < 0 else self._buf[:end]
        if not _NAME.fullmatch(candidate) or len(candidate) > _MAX_NAME:
            return self._give_back()
        if end < 0:
            if self._eof:
                return self._give_back()
            return False
        name = self._resolve_name(candidate)
        if name is None:
            return self._give_back()
        self._consume(end + 1)
        self._raw = []
        self._function = name
        self._num_parameters = 0
        self._seen_parameters = set()
        self._start_call(name)
        self._emit_arguments("{")
        self._state = "parameters"
        return True

    def _end_function(self) -> None:
        self._emit_arguments("}")
        self._close_call()

    def _state_parameters(self) -> bool:
        if not self._skip_whitespace():
            return False
        marker = self._starts_with((PARAMETER, END_FUNCTION, END_TOOL_CALL, FUNCTION, TOOL_CALL))
        if marker == "":
            return False
        if marker is None:  # stray text between parameters: drop up to the next tag
            nxt = self._buf.find("<", 1)
            self._consume(len(self._buf) if nxt < 0 else nxt)
            return True
        if marker != TOOL_CALL:
            self._consume(len(marker))
        if marker == PARAMETER:
            self._state = "parameter_name"
            return True
        self._end_function()
        if marker == END_FUNCTION:
            self._state = "after_function"
        elif marker == FUNCTION:
            self._raw = [marker]
            self._state = "function_name"
        else:
            self._state = "content"
        return True

    def _state_parameter_name(self) -> bool:
        end = self._buf.find(">")
        if end < 0:
            if self._eof:
                self._consume(len(self._buf))
            return False
        self._parameter = self._consume(end + 1)[:-1].strip()
        self._scan_from = self._tag_from = 0
        self._state = "parameter_value"
        return True

    def _next_tag(self, end: int) -> int:
        """Where the first opening or closing tag that ends a value with no `</parameter>`
        starts, before `end`; -1 if none (a possible partial tag keeps the scan back)."""
        buf = self._buf
        found = [p for p in (buf.find(t, self._tag_from, end) for t in _AFTER_PARAMETER) if p >= 0]
        if found:
            return min(found)
        longest = max(len(t) for t in _AFTER_PARAMETER)
        self._tag_from = max(self._tag_from, min(end, len(buf)) - longest + 1)
        return -1

    def _state_parameter_value(self) -> bool:
        buf = self._buf
        while True:
            pos = buf.find(END_PARAMETER, self._scan_from)
            tag = self._next_tag(len(buf) if pos < 0 else pos)
            if tag >= 0:  # `</parameter>` is missing: the value ends at the next tag
                self._end_parameter(tag, tag)
                return True
            if pos < 0:
                if self._eof:
                    self._end_parameter(len(buf), len(buf))
                    return True
                self._scan_from = max(self._scan_from, len(buf) - len(END_PARAMETER) + 1)
                return False
            after = buf[pos + len(END_PARAMETER) :].lstrip(_WHITESPACE)
            could_follow = not after or is_proper_prefix(after, _AFTER_PARAMETER)
            if any(after.startswith(m) for m in _AFTER_PARAMETER) or (could_follow and self._eof):
                self._end_parameter(pos, pos + len(END_PARAMETER))
                return True
            if could_follow:
                self._scan_from = pos
                return False
            self._scan_from = pos + 1  # `</parameter>` inside the value

    def _end_parameter(self, value_end: int, consumed: int) -> None:
        value = _strip_one_newline(self._buf[:value_end])
        self._consume(consumed)
        if self._parameter in self._seen_parameters:  # written twice: the first value stands
            self._state = "parameters"
            return
        self._seen_parameters.add(self._parameter)
        schema = self.tools.parameter_schema(self._function, self._parameter)
        separator = ", " if self._num_parameters else ""
        self._num_parameters += 1
        key = json.dumps(self._parameter, ensure_ascii=False)
        self._emit_arguments(f"{separator}{key}: {parameter_json(value, schema)}")
        self._state = "parameters"

    def _state_after_function(self) -> bool:
        if not self._skip_whitespace():
            return False
        marker = self._starts_with((END_TOOL_CALL, FUNCTION))
        if marker == "":
            return False
        if marker is not None:
            self._consume(len(marker))
        if marker == FUNCTION:
            self._raw = [marker]
            self._state = "function_name"
        else:
            self._state = "content"
        return True

    def _at_eof(self) -> None:
        if self._open_call is not None:
            self._emit_arguments("}")
        elif self._raw:
            self._emit_content("".join(self._raw))
            self._raw = []
