"""Shared steps of the marker-sectioned formats (DeepSeek-V3, Kimi-K2): a call's JSON
arguments stream until the JSON closes, then a call-end, next-call or section-end marker."""

from __future__ import annotations

from kvloom.cluster.parsers.tool_calls.base import ToolCallParser


class SectionedCallsParser(ToolCallParser):
    # Set by each format: the markers that may follow a call's arguments.
    call_begin: str
    call_end: str
    call_stop: tuple[str, ...]

    def _state_arguments(self) -> bool:
        if not self._buf and not self._eof:
            return False
        self._emit_arguments(self._arguments.feed(self._consume(len(self._buf)), self._eof))
        if not self._arguments.done:
            return False
        self._buf = self._arguments.rest + self._buf
        self._state = "after_arguments"
        return True

    def _state_after_arguments(self) -> bool:
        _, marker = self._take_until(self.call_stop)  # text after the JSON closed: dropped
        if marker is None:
            return False
        self._close_call()
        if marker == self.call_begin:
            self._begin_call()
        else:
            self._state = "section" if marker == self.call_end else "content"
        return True
