"""DeepSeek-V3 / R1 tool calls, and the V3.1 variant (the markers use the fullwidth bar
U+FF5C and U+2581, not ASCII):

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>                                   (V3)

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}
    <｜tool▁call▁end｜><｜tool▁calls▁end｜>                                       (V3.1)

After the separator, JSON means V3.1 (the name came before the separator); anything else is
V3's name line, then a fenced JSON block. What is content and what is a call: see
sectioned_calls.
"""

from __future__ import annotations

from kvloom.cluster.parsers.markers import find_first_marker, partial_marker_len
from kvloom.cluster.parsers.tool_calls.sectioned_calls import SectionedCallsParser

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
_WHITESPACE = " \t\r\n"
_NAME_END = ("\n", "`", "{", "[")


class DeepSeekV3ToolParser(SectionedCallsParser):
    section_begin = (CALLS_BEGIN,)
    section_end = (CALLS_END,)
    call_begin = CALL_BEGIN
    call_end = CALL_END

    name = "deepseek_v3"
    start_markers = (CALLS_BEGIN,)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._head: list[str] = []
        self._name = ""

    def _begin_call(self) -> None:
        self._head = []
        self._state = "head"

    def _state_head(self) -> bool:
        text, marker = self._take_until((SEP, *self.call_stop))
        self._head.append(text)
        self._call_raw.append(text)
        if marker is None:  # (a stream cut before the separator leaves no usable call)
            return False
        if marker != SEP:  # a call without a separator: nothing usable
            self._buf = marker + self._buf
            return self._fail_call()
        self._call_raw.append(marker)
        self._state = "after_sep"
        return True

    def _state_after_sep(self) -> bool:
        stripped = self._buf.lstrip(_WHITESPACE)
        if not stripped:
            return self._fail_call() if self._eof else False
        self._call_raw.append(self._consume(len(self._buf) - len(stripped)))
        head = "".join(self._head).strip()
        if stripped[0] in "{[" and head:  # V3.1: the head was the name
            name = self._resolve_name(head)
            if name is None:
                return self._fail_call()
            self._name = name
            self._state = "arguments_start"
        else:
            self._state = "name"
        return True

    def _state_name(self) -> bool:
        ends = [p for p in (self._buf.find(c) for c in _NAME_END) if p >= 0]
        marker_pos, _ = find_first_marker(self._buf, self.call_stop)
        if marker_pos >= 0:
            ends.append(marker_pos)
        if not ends:
            return self._fail_call() if self._eof else False
        written = self._consume(min(ends))
        self._call_raw.append(written)
        name = self._resolve_name(written)
        if name is None:
            return self._fail_call()
        self._name = name
        self._state = "fence"
        return True

    def _state_fence(self) -> bool:
        """Skips the ```json line up to the JSON (or the end of the call)."""
        starts = [p for p in (self._buf.find("{"), self._buf.find("[")) if p >= 0]
        marker_pos, _ = find_first_marker(self._buf, self.call_stop)
        if starts and (marker_pos < 0 or min(starts) < marker_pos):
            self._call_raw.append(self._consume(min(starts)))
            self._state = "arguments_start"
            return True
        if marker_pos >= 0 or self._eof:
            return self._fail_call()
        keep = partial_marker_len(self._buf, self.call_stop)
        self._call_raw.append(self._consume(len(self._buf) - keep))
        return False

    def _state_arguments_start(self) -> bool:
        return self._open_arguments(self._name)
