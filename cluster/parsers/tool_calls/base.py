"""The streaming tool-call parser contract and the machinery every format shares.

A parser is made per request. `feed(text)` takes the next piece of generated text (any
split: inside markers, inside JSON, across calls) and returns deltas; `finish()` flushes what
was held back and closes a call the stream left open. Whatever the split, the deltas sum to
the same message (checked by the tests for every format), argument fragments concatenate to
exactly the final arguments, and a call's id and name are sent once, before its arguments.

Subclasses implement `_step`, a state machine over `self._buf` (the text not yet used).
"""

from __future__ import annotations

import secrets
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Sequence
from typing import Any, ClassVar

from kvloom.cluster.parsers.deltas import Delta, DeltaBuilder
from kvloom.cluster.parsers.markers import find_first_marker, partial_marker_len
from kvloom.cluster.parsers.tool_calls.json_call_object import JsonCallObjectReader
from kvloom.cluster.parsers.tool_calls.tool_names import resolve_tool_name
from kvloom.cluster.parsers.tool_calls.tool_schemas import ToolSchemas

_WHITESPACE = " \t\r\n"

CallIdFactory = Callable[[int], str]


def openai_call_id(index: int) -> str:
    """`call_` and 24 random hex digits, as OpenAI's ids look."""
    return "call_" + secrets.token_hex(12)


class ToolCallParser(ABC):
    """Base of every format. Content text around calls passes through; whitespace right
    before a call, and at the end of a stream that ends with a call, is layout and dropped."""

    name: ClassVar[str] = ""
    # Markers that open this format's calls; they also end an open reasoning block.
    start_markers: ClassVar[tuple[str, ...]] = ()

    def __init__(
        self,
        tools: Sequence[dict[str, Any] | str] | None = None,
        call_id_factory: CallIdFactory | None = None,
    ) -> None:
        self.tools = ToolSchemas(tools)
        self._offered = frozenset(self.tools.names())
        self._make_call_id = call_id_factory or self.default_call_id
        self._buf = ""
        self._eof = False
        self._finished = False
        self._out = DeltaBuilder()
        self._num_calls = 0
        self._open_call: int | None = None
        self._call_has_arguments = False
        # Trailing content whitespace is held: dropped if a call follows, or if the stream ends
        # right after a call; emitted once more content follows.
        self._pending_whitespace = ""
        self._after_call = False

    @staticmethod
    def default_call_id(index: int) -> str:
        return openai_call_id(index)

    @property
    def num_tool_calls(self) -> int:
        return self._num_calls

    def feed(self, text: str) -> list[Delta]:
        if self._finished:
            raise RuntimeError("feed() after finish()")
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        self._buf += text
        self._drain()
        return self._out.take()

    def finish(self) -> list[Delta]:
        """End of stream: flush held-back text and close any open call. Idempotent."""
        if self._finished:
            return []
        self._eof = True
        self._drain()
        self._at_eof()
        self._close_call()
        if self._buf:  # a state that could not use its text: keep it as content
            self._emit_content(self._buf)
            self._buf = ""
        if not self._after_call:
            self._out.content(self._pending_whitespace)
        self._pending_whitespace = ""
        self._finished = True
        return self._out.take()

    def _drain(self) -> None:
        while self._step():
            pass

    @abstractmethod
    def _step(self) -> bool:
        """Uses what it can of self._buf; returns True if it made progress."""

    def _at_eof(self) -> None:  # noqa: B027 - an optional hook, empty by default
        """Called once after the final _drain at end of stream (self._eof is True)."""

    # ----- buffer helpers

    def _consume(self, size: int) -> str:
        taken, self._buf = self._buf[:size], self._buf[size:]
        return taken

    def _take_until(self, markers: Sequence[str]) -> tuple[str, str | None]:
        """Consumes and returns the text before the first complete marker and that marker.
        With no complete marker: the text that cannot start one (all of it at end of
        stream), and None; a possible partial marker at the end stays in the buffer."""
        pos, marker = find_first_marker(self._buf, markers)
        if marker is not None:
            text = self._consume(pos)
            self._consume(len(marker))
            return text, marker
        keep = 0 if self._eof else partial_marker_len(self._buf, markers)
        return self._consume(len(self._buf) - keep), None

    def _skip_whitespace(self) -> bool:
        """Drops leading whitespace; True if a non-whitespace character is available."""
        stripped = self._buf.lstrip(_WHITESPACE)
        self._buf = stripped
        return bool(stripped)

    def _starts_with(self, markers: Sequence[str]) -> str | None:
        """The marker the buffer starts with; "" if the buffer could still become one."""
        for marker in markers:
            if self._buf.startswith(marker):
                return marker
        if not self._eof and any(m.startswith(self._buf) for m in markers):
            return ""
        return None

    def _resolve_name(self, written: str) -> str | None:
        """The offered tool a written name means, or None: then it is not a call."""
        return resolve_tool_name(written, self._offered)

    def _call_object_reader(
        self, other_keys: Collection[str] | None = None, eager: bool = True
    ) -> JsonCallObjectReader:
        return JsonCallObjectReader(other_keys, resolve=self._resolve_name, eager=eager)

    def _feed_call_object(self, reader: JsonCallObjectReader) -> bool:
        """Hands the buffer to a call-object reader and applies what it found: the call
        starts when the reader commits it. Returns True when the reader has finished (done
        or failed); its unused text is back in the buffer."""
        if not self._buf and not self._eof:
            return False
        for kind, value in reader.feed(self._consume(len(self._buf)), eof=self._eof):
            if kind == "call":
                self._start_call(value)
            else:
                self._emit_arguments(value)
        if not (reader.done or reader.failed):
            return False
        self._buf = reader.rest + self._buf
        return True

    # ----- output helpers

    def _emit_content(self, text: str) -> None:
        body = text.rstrip(_WHITESPACE)
        if not body:
            self._pending_whitespace += text
            return
        self._out.content(self._pending_whitespace + body)
        self._pending_whitespace = text[len(body) :]
        self._after_call = False

    def _drop_pending_whitespace(self) -> None:
        """The whitespace held after the last content is layout (e.g. inside a section)."""
        self._pending_whitespace = ""

    def _start_call(self, name: str, call_id: str | None = None) -> None:
        self._close_call()
        index = self._num_calls
        self._num_calls += 1
        self._open_call = index
        self._call_has_arguments = False
        self._pending_whitespace = ""
        self._out.call_start(index, call_id or self._make_call_id(index), name)

    def _emit_arguments(self, text: str) -> None:
        if self._open_call is None:
            raise RuntimeError("arguments outside a tool call")
        if text:
            self._call_has_arguments = True
            self._out.call_arguments(self._open_call, text)

    def _close_call(self) -> None:
        if self._open_call is None:
            return
        if not self._call_has_arguments:  # a call without arguments still gets a JSON object
            self._out.call_arguments(self._open_call, "{}")
        self._open_call = None
        self._after_call = True
