"""Incremental JSON scanning for streamed tool-call arguments.

Parsers stream the model's argument text as it is written, without re-serialising it, so the
fragments concatenate to exactly the final arguments. What they need to know is where the JSON
value ends and which characters are inside strings (where marker text is argument text).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from kvloom.cluster.parsers.markers import partial_marker_len

_STRING_SPECIAL = re.compile(r'["\\]')
_WHITESPACE = " \t\r\n"
_TRACKED = '"\\{}[]'  # the characters whose count the scanner's state depends on


class JsonValueScanner:
    """Tracks one JSON value through text that arrives in pieces: nesting depth, whether the
    position is inside a string, and whether the value has ended.

    `stop_markers` are markers that end the value even if it is unbalanced (a model that
    closed the call without closing its JSON); they count only outside strings.
    """

    def __init__(self, stop_markers: Sequence[str] = ()) -> None:
        for marker in stop_markers:
            # Held-back partial markers are scanned again, which must not change the state.
            if len(marker) < 2 or marker[0] in _WHITESPACE or any(c in _TRACKED for c in marker):
                raise ValueError(f"stop marker {marker!r} must not contain JSON syntax")
        self._stop_markers = frozenset(stop_markers)
        alternatives = [re.escape(m) for m in stop_markers]
        self._container_special = re.compile("|".join([*alternatives, r'["{}\[\]]']))
        self._scalar_end = re.compile("|".join([*alternatives, r"[\s,\]}]"]))
        self.depth = 0
        self.in_string = False
        self._escape = False
        self.kind: str | None = None  # "string", "container" or "scalar" once started
        self.done = False
        self.stopped_at_marker: str | None = None

    def scan(self, text: str, pos: int = 0) -> int:
        """Advances over text[pos:]. Returns where it stopped: just past the value's last
        character when it ended (`done`), at a stop marker (`stopped_at_marker`), or len(text).
        A scalar ends before the character that ends it, which is left unscanned."""
        end = len(text)
        while pos < end and not self.done and self.stopped_at_marker is None:
            if self._escape:
                self._escape = False
                pos += 1
            elif self.in_string:
                match = _STRING_SPECIAL.search(text, pos)
                if match is None:
                    return end
                pos = match.start()
                if text[pos] == "\\":
                    if pos + 1 == end:
                        self._escape = True
                        return end
                    pos += 2
                else:
                    self.in_string = False
                    pos += 1
                    self.done = self.depth == 0
            elif self.kind is None:
                char = text[pos]
                if char in _WHITESPACE:
                    pos += 1
                elif char == '"':
                    self.kind, self.in_string = "string", True
                    pos += 1
                elif char in "{[":
                    self.kind, self.depth = "container", 1
                    pos += 1
                else:
                    self.kind = "scalar"
            elif self.kind == "scalar":
                match = self._scalar_end.search(text, pos)
                if match is None:
                    return end
                pos = match.start()
                if match.group() in self._stop_markers:
                    self.stopped_at_marker = match.group()
                else:
                    self.done = True
            else:
                match = self._container_special.search(text, pos)
                if match is None:
                    return end
                pos = match.start()
                token = match.group()
                if token in self._stop_markers:
                    self.stopped_at_marker = token
                elif token == '"':
                    self.in_string = True
                    pos += 1
                elif token in "{[":
                    self.depth += 1
                    pos += 1
                else:
                    self.depth -= 1
                    pos += 1
                    self.done = self.depth == 0
        return pos


class JsonArgsStreamer:
    """Streams the raw text of one JSON arguments value that is followed by an end marker.

    Leading whitespace is skipped; trailing whitespace and a possible partial end marker are
    held back until the next piece shows what they are (they hold no JSON syntax, so the
    scanner reads them again next time without changing its state). The value ends when it closes, or at
    an end marker outside strings (malformed JSON). After `done`, `rest` holds the unconsumed
    text (starting at the end marker, if one stopped it).
    """

    def __init__(self, end_markers: Sequence[str] = ()) -> None:
        self._markers = tuple(end_markers)
        self._scanner = JsonValueScanner(self._markers)
        self._buf = ""  # text not emitted yet
        self._started = False
        self.done = False
        self.rest = ""

    def feed(self, text: str, eof: bool = False) -> str:
        """Takes the next piece; returns the argument text that is now certain."""
        if self.done:
            raise RuntimeError("JsonArgsStreamer fed after its value ended")
        self._buf += text
        if not self._started:
            stripped = self._buf.lstrip(_WHITESPACE)
            self._buf = stripped
            if not stripped:
                return ""
            self._started = True
        scanner = self._scanner
        stop = scanner.scan(self._buf)
        if scanner.done or scanner.stopped_at_marker is not None:
            emit = self._buf[:stop]
            if scanner.stopped_at_marker is not None:
                emit = emit.rstrip(_WHITESPACE)
            self.rest = self._buf[stop:]
            self._buf, self.done = "", True
            return emit
        if eof or scanner.in_string:
            emit, self._buf = self._buf, ""
            return emit
        hold = partial_marker_len(self._buf, self._markers)
        body = self._buf[: len(self._buf) - hold]
        cut = len(body.rstrip(_WHITESPACE))
        emit, self._buf = self._buf[:cut], self._buf[cut:]
        return emit
