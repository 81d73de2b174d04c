"""Kimi-K2 tool calls:

    <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0
    <|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>

The call id is the text between call begin and argument begin (`functions.NAME:IDX`, kept as
the id because Kimi's template expects it back in history); the name is the part between
`functions.` and the last `:`. A section the stream leaves open still yields its calls.
"""

from __future__ import annotations

from kvloom.cluster.parsers.json_scan import JsonArgsStreamer
from kvloom.cluster.parsers.tool_calls.sectioned_calls import SectionedCallsParser

SECTION_BEGIN = ("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>")
SECTION_END = ("<|tool_calls_section_end|>", "<|tool_call_section_end|>")
CALL_BEGIN = "<|tool_call_begin|>"
ARGUMENT_BEGIN = "<|tool_call_argument_begin|>"
CALL_END = "<|tool_call_end|>"
_CALL_STOP = (CALL_END, CALL_BEGIN, *SECTION_END)  # what ends a call's arguments


def name_from_call_id(call_id: str) -> str:
    """`functions.get_weather:0` -> `get_weather`."""
    name = call_id.removeprefix("functions.")
    return name.rsplit(":", 1)[0] if ":" in name else name


class KimiK2ToolParser(SectionedCallsParser):
    call_begin = CALL_BEGIN
    call_end = CALL_END
    call_stop = _CALL_STOP

    name = "kimi_k2"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._state = "content"
        self._call_id: list[str] = []
        self._arguments = JsonArgsStreamer(_CALL_STOP)

    def _step(self) -> bool:
        return getattr(self, "_state_" + self._state)()

    def _state_content(self) -> bool:
        text, marker = self._take_until((*SECTION_BEGIN, CALL_BEGIN))
        self._emit_content(text)
        if marker is None:
            return False
        if marker == CALL_BEGIN:
            self._begin_call()
        else:
            self._state = "section"
        return True

    def _begin_call(self) -> None:
        self._call_id = []
        self._state = "call_id"

    def _state_section(self) -> bool:
        _, marker = self._take_until((CALL_BEGIN, *SECTION_END))  # text between calls: layout
        if marker is None:
            return False
        if marker == CALL_BEGIN:
            self._begin_call()
        else:
            self._state = "content"
        return True

    def _state_call_id(self) -> bool:
        text, marker = self._take_until((ARGUMENT_BEGIN, *_CALL_STOP))
        self._call_id.append(text)
        if marker is None:  # (a stream cut inside the id leaves no usable call)
            return False
        call_id = "".join(self._call_id).strip()
        name = name_from_call_id(call_id)
        if marker == ARGUMENT_BEGIN and name:
            self._start_call(name, call_id)
            self._arguments = JsonArgsStreamer(_CALL_STOP)
            self._state = "arguments"
            return True
        if name:  # a call with no arguments part
            self._start_call(name, call_id)
        self._buf = marker + self._buf
        self._state = "after_arguments"
        return True
