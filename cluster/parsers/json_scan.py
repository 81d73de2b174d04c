"""Incremental JSON scanning: where a JSON value ends in text that arrives in pieces, and
which characters are inside strings (where marker text is value text). Values parsers only
skip or read whole use this; arguments that stream use json_object_stream, which also checks
the grammar.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

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
