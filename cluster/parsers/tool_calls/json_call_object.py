"""Reads one `{"name": ..., "arguments": {...}}` tool-call object from streamed text.

Used by the formats that write a call as a JSON object (Hermes/Qwen, Llama 3, Mistral before
v11). The name is reported once it is complete; the arguments value is reported as raw text
as it arrives (a string-encoded arguments value is decoded once complete).
"""

from __future__ import annotations

import json
from collections.abc import Collection

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
    """One call object. `feed` returns events ("name", str) and ("arguments", str).

    After `done` (the object closed) or `failed` (the text is not such an object, or ended
    early), `rest` holds the text the reader did not use and `consumed` the text it did.
    `other_keys` lists keys tolerated before the name; None tolerates any key.
    """

    def __init__(self, other_keys: Collection[str] | None = None) -> None:
        self._other_keys = other_keys
        self._buf = ""
        self._state = "open"
        self._key = ""
        self._kind = ""  # of the value being read: name, arguments, arguments_string, skip
        self._scanner: JsonValueScanner | None = None
        self._value: list[str] = []
        self._seen_arguments = False
        self._consumed: list[str] = []
        self.name: str | None = None
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
        if eof and not self.done:
            self.failed = True
        if self.done or self.failed:
            self.rest, self._buf = self._buf, ""
        return events

    def _consume(self, size: int) -> None:
        self._consumed.append(self._buf[:size])
        self._buf = self._buf[size:]

    def _skip_whitespace(self) -> bool:
        """Consumes leading whitespace; True if a non-whitespace character follows."""
        stripped = self._buf.lstrip(_WHITESPACE)
        self._consume(len(self._buf) - len(stripped))
        return bool(self._buf)

    def _fail(self) -> bool:
        self.failed = True
        return False

    def _step(self, events: list[tuple[str, str]], eof: bool) -> bool:
        state = self._state
        if state == "in_value":
            return self._read_value(events, eof)
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
            return self._start_value(char)
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

    def _start_value(self, char: str) -> bool:
        key = self._key
        if key in NAME_KEYS and self.name is None:
            if char != '"':
                return self._fail()
            self._kind = "name"
        elif key in ARGUMENT_KEYS and not self._seen_arguments:
            self._seen_arguments = True
            self._kind = "arguments_string" if char == '"' else "arguments"
        else:
            if self.name is None and self._other_keys is not None and key not in self._other_keys:
                return self._fail()
            self._kind = "skip"
        self._scanner = JsonValueScanner()
        self._value = []
        self._state = "in_value"
        return True

    def _read_value(self, events: list[tuple[str, str]], eof: bool) -> bool:
        scanner = self._scanner
        assert scanner is not None
        stop = scanner.scan(self._buf)
        piece = self._buf[:stop]
        self._consume(stop)
        if self._kind == "arguments":
            if piece:
                events.append(("arguments", piece))
        elif self._kind != "skip":
            self._value.append(piece)
        ended = scanner.done or (eof and scanner.kind == "scalar")
        if not ended:
            return False
        if self._kind in ("name", "arguments_string"):
            try:
                value = json.loads("".join(self._value))
            except ValueError:
                return self._fail()
            if self._kind == "arguments_string":
                events.append(("arguments", value))
            elif not value:
                return self._fail()
            else:
                self.name = value
                events.append(("name", value))
        self._state = "after_value"
        return True
