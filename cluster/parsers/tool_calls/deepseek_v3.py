"""DeepSeek-V3 / R1 tool calls, and the V3.1 variant (the markers use the fullwidth bar
U+FF5C and U+2581, not ASCII):

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>                                   (V3)

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}
    <｜tool▁call▁end｜><｜tool▁calls▁end｜>                                       (V3.1)

After the separator, JSON means V3.1 (the name came before the separator); anything else is
V3's name line, then a fenced JSON block.
"""

from __future__ import annotations

from kvloom.cluster.parsers.json_scan import JsonArgsStreamer
from kvloom.cluster.parsers.markers import find_first_marker, partial_marker_len
from kvloom.cluster.parsers.tool_calls.sectioned_calls import SectionedCallsParser

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
_CALL_STOP = (CALL_END, CALL_BEGIN, CALLS_END)
_WHITESPACE = " \t\r\n"
_NAME_END = ("\n", "`", "{", "[")


class DeepSeekV3ToolParser(SectionedCallsParser):
    call_begin = CALL_BEGIN
    call_end = CALL_END
    call_stop = _CALL_STOP

    name = "deepseek_v3"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._state = "content"
        self._head: list[str] = []
        self._arguments = JsonArgsStreamer(_CALL_STOP)

    def _step(self) -> bool:
        return getattr(self, "_state_" + self._state)()

    def _begin_call(self) -> None:
        self._head = []
        self._state = "head"

    def _state_content(self) -> bool:
        text, marker = self._take_until((CALLS_BEGIN, CALL_BEGIN))
        self._emit_content(text)
        if marker is None:
            return False
        if marker == CALL_BEGIN:
            self._begin_call()
        else:
            self._state = "section"
        return True

    def _state_section(self) -> bool:
        _, marker = self._take_until((CALL_BEGIN, CALLS_END))  # text between calls: layout
        if marker is None:
            return False
        if marker == CALL_BEGIN:
            self._begin_call()
        else:
            self._state = "content"
        return True

    def _state_head(self) -> bool:
        text, marker = self._take_until((SEP, *_CALL_STOP))
        self._head.append(text)
        if marker is None:  # (a stream cut before the separator leaves no usable call)
            return False
        if marker == SEP:
            self._state = "after_sep"
        else:  # a call without a separator: nothing usable
            self._buf = marker + self._buf
            self._state = "section"
        return True

    def _state_after_sep(self) -> bool:
        stripped = self._buf.lstrip(_WHITESPACE)
        if not stripped:
            return False
        head = "".join(self._head).strip()
        if stripped[0] in "{[" and head:  # V3.1: the head was the name
            self._buf = stripped
            self._start_call(head)
            self._open_arguments()
        else:
            self._buf = stripped
            self._state = "name"
        return True

    def _state_name(self) -> bool:
        ends = [p for p in (self._buf.find(c) for c in _NAME_END) if p >= 0]
        marker_pos, _ = find_first_marker(self._buf, _CALL_STOP)
        if marker_pos >= 0:
            ends.append(marker_pos)
        if not ends:
            if self._eof and self._buf.strip():
                self._start_call(self._consume(len(self._buf)).strip())
            return False
        name = self._consume(min(ends)).strip()
        if name:
            self._start_call(name)
            self._state = "fence"
        else:  # no name: skip this call
            self._state = "after_arguments"
        return True

    def _state_fence(self) -> bool:
        """Skips the ```json line up to the JSON (or the end of the call)."""
        starts = [p for p in (self._buf.find("{"), self._buf.find("[")) if p >= 0]
        marker_pos, _ = find_first_marker(self._buf, _CALL_STOP)
        if starts and (marker_pos < 0 or min(starts) < marker_pos):
            self._consume(min(starts))
            self._open_arguments()
            return True
        if marker_pos >= 0:
            self._consume(marker_pos)
            self._state = "after_arguments"
            return True
        keep = 0 if self._eof else partial_marker_len(self._buf, _CALL_STOP)
        self._consume(len(self._buf) - keep)
        return False

    def _open_arguments(self) -> None:
        self._arguments = JsonArgsStreamer(_CALL_STOP)
        self._state = "arguments"
