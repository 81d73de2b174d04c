"""Kimi-K2 tool calls:

    <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0
    <|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>

The call id is the text between call begin and argument begin (`functions.NAME:IDX`, kept as
the id because Kimi's template renders it back into history, and it is the only place the
name reaches the model there); the name is the part between `functions.` and the last `:`,
resolved against the offered tools (tool_names: `functions_NAME_IDX`, `functionsNAME`). When
tools are offered, an id that is not `functions.NAME:IDX` for the resolved name is given back
in that form. A section the stream leaves open still yields its calls.
"""

from __future__ import annotations

import re

from kvloom.cluster.parsers.tool_calls.sectioned_calls import SectionedCallsParser
from kvloom.cluster.parsers.tool_calls.tool_names import call_index_of

SECTION_BEGIN = ("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>")
SECTION_END = ("<|tool_calls_section_end|>", "<|tool_call_section_end|>")
CALL_BEGIN = "<|tool_call_begin|>"
ARGUMENT_BEGIN = "<|tool_call_argument_begin|>"
CALL_END = "<|tool_call_end|>"


def name_from_call_id(call_id: str) -> str:
    """`functions.get_weather:0` -> `get_weather`."""
    name = call_id.removeprefix("functions.")
    return name.rsplit(":", 1)[0] if ":" in name else name


class KimiK2ToolParser(SectionedCallsParser):
    section_begin = SECTION_BEGIN
    section_end = SECTION_END
    call_begin = CALL_BEGIN
    call_end = CALL_END

    name = "kimi_k2"
    start_markers = SECTION_BEGIN

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._call_id: list[str] = []
        self._name = ""
        self._id = ""

    def _begin_call(self) -> None:
        self._call_id = []
        self._state = "call_id"

    def _canonical_id(self, call_id: str, name: str) -> str:
        if not self._offered or re.fullmatch(rf"functions\.{re.escape(name)}:\d+", call_id):
            return call_id
        index = call_index_of(call_id)
        return f"functions.{name}:{self._num_calls if index is None else index}"

    def _state_call_id(self) -> bool:
        text, marker = self._take_until((ARGUMENT_BEGIN, *self.call_stop))
        self._call_id.append(text)
        self._call_raw.append(text)
        if marker is None:  # (a stream cut inside the id leaves no usable call)
            return False
        call_id = "".join(self._call_id).strip()
        name = self._resolve_name(name_from_call_id(call_id))
        if name is None:
            self._buf = marker + self._buf
            return self._fail_call()
        self._name, self._id = name, self._canonical_id(call_id, name)
        if marker == ARGUMENT_BEGIN:
            self._call_raw.append(marker)
            self._state = "before_arguments"
            return True
        # A call with no arguments part: a call without arguments.
        self._commit(name, self._id)
        self._buf = marker + self._buf
        self._state = "after_arguments"
        return True

    def _state_before_arguments(self) -> bool:
        return self._open_arguments(self._name, self._id)
