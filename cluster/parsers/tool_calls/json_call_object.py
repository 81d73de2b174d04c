"""Reads one `{"name": ..., "arguments": {...}}` tool-call object from streamed text.

Used by the formats that write a call as a JSON object (Hermes/Qwen, Llama 3, Mistral before
v11, MiniMax-M1). The rules (docs/parsers.md):

- the name must be a string that resolves to an offered tool (`resolve`), else no call;
- the arguments must be a JSON object (`{...}`, streamed as written, see json_object_stream),
  a string holding a JSON object (decoded once complete), `null` or absent (then `{}`);
  anything else (`"hello"`, a number, a list) means the object is not a call;
- an eager reader commits the call (reports `("call", name)`) once the name is known and the
  arguments object has begun, or the call object closed; a lazy one (`eager=False`) leaves
  the decision to the caller once the call object closed (`done`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection

from kvloom.cluster.parsers.json_object_stream import JsonObjectStreamer
from kvloom.cluster.parsers.json_scan import JsonValueScanner

NAME_KEYS = ("name",)
ARGUMENT_KEYS = ("arguments", "parameters")
_WHITESPACE = " \t\r\n"


def _string_end(text: str, start: int) -> int:
    """Index just past the JSON string starting at text[start] == '"', or -1 if incomplete."""
    pos = start + 1
    while True:
        quote = text.find('"', pos)
        if quote < 0:
            return -1
        backslashes = 0
        while text[quote - 1 - backslashes] == "\\":
            backslashes += 1
        if backslashes % 2 == 0:
            return quote + 1
        pos = quote + 1


class JsonCallObjectReader:
    """One call object. `feed` returns events ("call", name) and ("arguments", text).

    After `done` (the object closed) or `failed` (the text is not such an object, or ended
    early), `rest` holds the text the reader did not use and `consumed` the text it did;
    `committed` says whether the call was reported (a committed call whose object then
    broke still stands: its arguments were closed). A lazy reader keeps the arguments in
    `arguments` (None when absent). `other_keys` lists keys tolerated before the name; None
    tolerates any key.
    """

    def __init__(
        self,
        other_keys: Collection[str] | None = None,
        resolve: Callable[[str], str | None] | None = None,
        eager: bool = True,
    ) -> None:
        self._other_keys = other_keys
        self._resolve = resolve or (lambda name: name.strip() or None)
        self._eager = eager
        self._buf = ""
        self._state = "open"
        self._key = ""
        self._kind = ""  # of the value being read: name, arguments_string, arguments_null, skip
        self._scanner: JsonValueScanner | None = None
        self._object: JsonObjectStreamer | None = None
        self._value: list[str] = []
        self._seen_arguments = False
        self._consumed: list[str] = []
        self._pending: list[str] = []  # arguments read before the call is committed
        self.name: str | None = None
        self.arguments: str | None = None
        self.committed = False
        self.done = False
        self.failed = False
        self.rest = ""

    @property
    def consumed(self) -> str:
        return "".join(self._consumed)

    def feed(self, text: str, eof: bool = False) -> list[tuple[str, str]]:
        events: list[tuple[str, str]] = []
        self._buf += text
        while not (self.done or self.failed) and self._step(events, eof):
            pass
        if eof and not (self.done or self.failed):
            self._fail(events)
        if self.done and self._eager and self.name is not None and not self.committed:
            self._commit(events)
        if self.done or self.failed:
            self.rest, self._buf = self._buf, ""
        return events

    def _commit(self, events: list[tuple[str, str]]) -> None:
        assert self.name is not None
        self.committed = True
        events.append(("call", self.name))
        events.extend(("arguments", piece) for piece in self._pending if piece)
        self._pending = []

    def _arguments(self, events: list[tuple[str, str]], piece: str) -> None:
        if not piece:
            return
        self.arguments = (self.arguments or "") + piece
        if self.committed:
            events.append(("arguments", piece))
        else:
            self._pending.append(piece)

    def _consume(self, size: int) -> None:
        self._consumed.append(self._buf[:size])
        self._buf = self._buf[size:]

    def _skip_whitespace(self) -> bool:
        """Consumes leading whitespace; True if a non-whitespace character follows."""
        stripped = self._buf.lstrip(_WHITESPACE)
        self._consume(len(self._buf) - len(stripped))
        return bool(self._buf)

    def _fail(self, events: list[tuple[str, str]] | None = None) -> bool:
        """Not a call (or, once committed, the end of what can be used of it)."""
        if self._object is not None and not self._object.ended:  # cut inside the arguments
            piece = self._object.feed("", eof=True)
            self._consumed.append(self._object.raw_consumed)
            if events is not None:
                self._arguments(events, piece)
            self._object = None
        self.failed = True
        return False

    def _step(self, events: list[tuple[str, str]], eof: bool) -> bool:
        state = self._state
        if state == "in_value":
            return self._read_value(events, eof)
        if state == "in_object":
            return self._read_object(events, eof)
        if not self._skip_whitespace():
            return False
        char = self._buf[0]
        if state == "open":
            if char != "{":
                return self._fail()
            self._consume(1)
            self._state = "key"
        elif state == "key":
            if char == "}":
                self._consume(1)
                self.done = True
                return False
            if char != '"':
                return self._fail()
            end = _string_end(self._buf, 0)
            if end < 0:
                return False
            try:
                self._key = json.loads(self._buf[:end])
            except ValueError:
                return self._fail()
            self._consume(end)
            self._state = "colon"
        elif state == "colon":
            if char != ":":
                return self._fail()
            self._consume(1)
            self._state = "value"
        elif state == "value":
            return self._start_value(char, events)
        elif state == "after_value":
            if char == ",":
                self._consume(1)
                self._state = "key"
            elif char == "}":
                self._consume(1)
                self.done = True
                return False
            else:
                return self._fail()
        return True

    def _start_value(self, char: str, events: list[tuple[str, str]]) -> bool:
        key = self._key
        if key in NAME_KEYS and self.name is None:
            if char != '"':
                return self._fail()
            self._kind = "name"
        elif key in ARGUMENT_KEYS and not self._seen_arguments:
            self._seen_arguments = True
            if char == "{":
                self._object = JsonObjectStreamer()
                self._state = "in_object"
                if self._eager and self.name is not None:
                    self._commit(events)
                return True
            if char not in '"n':  # a number, a list, true/false: not an object
                return self._fail()
            self._kind = "arguments_string" if char == '"' else "arguments_null"
        else:
            if self.name is None and self._other_keys is not None and key not in self._other_keys:
                return self._fail()
            self._kind = "skip"
        self._scanner = JsonValueScanner()
        self._value = []
        self._state = "in_value"
        return True

    def _read_object(self, events: list[tuple[str, str]], eof: bool) -> bool:
        streamer = self._object
        assert streamer is not None
        if not self._buf and not eof:
            return False
        piece = streamer.feed(self._buf, eof=eof)
        self._buf = ""
        self._arguments(events, piece)
        if not streamer.ended:
            return False
        self._consumed.append(streamer.raw_consumed)
        self._buf = streamer.rest
        self._object = None
        if streamer.broken:
            self.failed = True
            return False
        self._state = "after_value"
        return True

    def _read_value(self, events: list[tuple[str, str]], eof: bool) -> bool:
        scanner = self._scanner
        assert scanner is not None
        stop = scanner.scan(self._buf)
        piece = self._buf[:stop]
        self._consume(stop)
        if self._kind != "skip":
            self._value.append(piece)
        ended = scanner.done or (eof and scanner.kind == "scalar")
        if not ended:
            return False
        if self._kind != "skip":
            try:
                value = json.loads("".join(self._value))
            except ValueError:
                return self._fail()
            if not self._use_value(value, events):
                return self._fail()
        self._state = "after_value"
        return True

    def _use_value(self, value: object, events: list[tuple[str, str]]) -> bool:
        if self._kind == "name":
            name = self._resolve(value) if isinstance(value, str) else None
            if name is None:
                return False
            self.name = name
            if self._eager and self.arguments is not None:  # the arguments came first
                self._commit(events)
        elif self._kind == "arguments_string":  # a string that holds the JSON object
            try:
                decoded = json.loads(value) if isinstance(value, str) else None
            except ValueError:
                return False
            if not isinstance(decoded, dict):
                return False
            self._arguments(events, value.strip())  # type: ignore[union-attr]
        elif value is not None:  # arguments_null: anything but null is not an object
            return False
        return True
