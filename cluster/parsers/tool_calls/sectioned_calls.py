"""Shared steps of the marker-sectioned formats (DeepSeek-V3, Kimi-K2): a section of calls,
each call a head (name or id) and JSON-object arguments between call markers.

The rules (docs/parsers.md): a call starts only once its name resolves and its arguments
begin with `{`; a call that fails before that (no separator, a name that is no offered tool,
arguments that are not an object, a stream cut before its arguments) is content, marker
text included, as is a section with no call in it. Whitespace between calls is layout;
other text in a section, and everything after it, is content. The arguments stream as
written and are closed if the model stops inside them (json_object_stream).
"""

from __future__ import annotations

from kvloom.cluster.parsers.json_object_stream import JsonObjectStreamer
from kvloom.cluster.parsers.tool_calls.base import ToolCallParser

_WHITESPACE = " \t\r\n"


class SectionedCallsParser(ToolCallParser):
    # Set by each format.
    section_begin: tuple[str, ...]
    section_end: tuple[str, ...]
    call_begin: str
    call_end: str

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._state = "content"
        # The section's text while it has no call; None once it was given back as content.
        self._section_raw: list[str] | None = []
        self._section_has_call = False
        self._call_raw: list[str] = []  # the current call's text until it starts
        self._arguments = JsonObjectStreamer()

    @property
    def call_stop(self) -> tuple[str, ...]:
        """What ends a call: its end marker, the next call, the end of the section."""
        return (self.call_end, self.call_begin, *self.section_end)

    def _step(self) -> bool:
        return getattr(self, "_state_" + self._state)()

    def _begin_call(self) -> None:
        """Called after the call-begin marker was consumed; sets the format's first state."""
        raise NotImplementedError

    def _state_content(self) -> bool:
        text, marker = self._take_until((*self.section_begin, self.call_begin))
        self._emit_content(text)
        if marker is None:
            return False
        self._section_has_call = False
        if marker == self.call_begin:
            self._section_raw = []
            self._call_raw = [marker]
            self._begin_call()
        else:
            self._section_raw = [marker]
            self._state = "section"
        return True

    def _state_section(self) -> bool:
        text, marker = self._take_until((self.call_begin, *self.section_end))
        if self._section_raw is not None and not self._section_has_call:
            if text.strip(_WHITESPACE):  # a malformed section: its text so far is content
                self._emit_content("".join(self._section_raw) + text)
                self._section_raw = None
            else:
                self._section_raw.append(text)
        else:  # (whitespace waits: dropped before a call or at the section's end)
            self._emit_content(text)
        if marker is None:
            return False
        if marker == self.call_begin:
            self._call_raw = [marker]
            self._begin_call()
            return True
        if self._section_has_call:
            self._drop_pending_whitespace()
        else:
            self._emit_content("".join(self._section_raw or ()) + marker)
        self._section_raw = []
        self._state = "content"
        return True

    def _fail_call(self) -> bool:
        """The call is not one: its text, to its end marker, is content."""
        self._state = "failed_call"
        return True

    def _state_failed_call(self) -> bool:
        text, marker = self._take_until(self.call_stop)
        self._call_raw.append(text)
        if marker is None and not self._eof:
            return False
        if marker == self.call_end:
            self._call_raw.append(marker)
        elif marker is not None:
            self._buf = marker + self._buf
        self._emit_content("".join((self._section_raw or []) + self._call_raw))
        self._section_raw, self._call_raw = None, []
        self._state = "section"
        return True

    def _open_arguments(self, name: str, call_id: str | None = None) -> bool:
        """At the arguments: the call starts if they are a JSON object."""
        stripped = self._buf.lstrip(_WHITESPACE)
        if not stripped:
            if self._eof:
                return self._fail_call()
            return False
        if stripped[0] != "{":
            return self._fail_call()
        self._buf = stripped
        self._commit(name, call_id)
        self._arguments = JsonObjectStreamer()
        self._state = "arguments"
        return True

    def _commit(self, name: str, call_id: str | None) -> None:
        self._section_raw, self._call_raw = [], []
        self._section_has_call = True
        self._start_call(name, call_id)

    def _state_arguments(self) -> bool:
        if not self._buf and not self._eof:
            return False
        self._emit_arguments(self._arguments.feed(self._consume(len(self._buf)), self._eof))
        if not self._arguments.ended:
            return False
        self._buf = self._arguments.rest + self._buf
        self._state = "after_arguments"
        return True

    def _state_after_arguments(self) -> bool:
        _, marker = self._take_until(self.call_stop)  # inside the call markers: layout
        if marker is None:
            return False
        self._close_call()
        self._after_call_marker(marker)
        return True

    def _after_call_marker(self, marker: str) -> None:
        if marker == self.call_begin:
            self._call_raw = [marker]
            self._begin_call()
        else:
            self._state = "section" if marker == self.call_end else "content"

    def _at_eof(self) -> None:
        if self._open_call is None and not self._section_has_call:
            self._emit_content("".join((self._section_raw or []) + self._call_raw))
        elif self._open_call is None:
            self._emit_content("".join(self._call_raw))
        self._section_raw, self._call_raw = [], []
