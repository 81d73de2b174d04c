"""Streaming one JSON object (a tool call's arguments) so that what was sent is always a
valid beginning of an object, and can be closed into a valid object if the model stops.

The model's text is checked against JSON's grammar as it arrives and passed on verbatim,
except raw control characters inside strings, which are sent escaped (strict JSON parsers
reject them). Text is sent only up to the last *safe point*: a place where closing the open
string and containers gives valid JSON (just after `{` or `[`, inside a string value, just
after a complete value). Keys, commas, numbers and literals wait until their value is safe.

The object ends `done` when it closes, or `broken` at the first character JSON does not
allow there (for example the call's end marker while the object is open), or at end of
stream; a broken object is closed by `closing()`: the open string and containers closed,
the unsafe tail dropped. `rest` then holds the text from the character that broke it.
"""

from __future__ import annotations

import re

_WHITESPACE = " \t\r\n"
_STRING_STOP = re.compile(r'["\\\x00-\x1f]')
_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")
_NUMBER_CHARS = frozenset("0123456789+-.eE")
_ESCAPES = frozenset('"\\/bfnrtu')
_LITERALS = {"t": "true", "f": "false", "n": "null"}
_HEX = frozenset("0123456789abcdefABCDEF")
_CONTROL_ESCAPES = {"\n": "\\n", "\t": "\\t", "\r": "\\r", "\b": "\\b", "\f": "\\f"}


class JsonObjectStreamer:
    """One object's text in, the safe part of it out; see the module docstring."""

    def __init__(self) -> None:
        self._text = ""  # fed, not yet sent
        self._pos = 0  # scan position in _text
        self._safe = 0  # _text[:_safe] may be sent
        self._safe_in_string = False
        self._stack: list[str] = []
        self._state = "start"
        self._in_key = False
        self._hex_left = 0
        self._token = ""  # the number or literal being read
        self._literal = ""
        self.started = False  # the opening brace was seen
        self.done = False
        self.broken = False
        self.rest = ""
        self._closing_sent = False
        self._stack_at_safe: list[str] = []
        self._raw = ""

    @property
    def ended(self) -> bool:
        return self.done or self.broken

    def feed(self, text: str, eof: bool = False) -> str:
        """Takes the next piece; returns the text now safe to send (closed, when the object
        breaks or the stream ends)."""
        if self.ended:
            raise RuntimeError("JsonObjectStreamer fed after its object ended")
        self._text += text
        self._raw += text
        if not self.started:  # whitespace before the object is layout
            self._text = self._text.lstrip(_WHITESPACE)  # (nothing was scanned yet)
        self._scan()
        if eof and not self.ended:  # (a number that ends here was marked safe as read)
            self.broken = True
            self.rest = ""
        if self.ended:
            return self._take(self._safe) + (self.closing() if self.broken else "")
        return self._take(self._safe)

    def closing(self) -> str:
        """What closes a broken object (once): `closing_if_cut()`."""
        if self._closing_sent:
            return ""
        self._closing_sent = True
        return self.closing_if_cut()

    def closing_if_cut(self) -> str:
        """What would close the text sent so far: a quote for an open string, then the
        brackets."""
        if not self.started:
            return ""
        quote = '"' if self._safe_in_string else ""
        return quote + "".join("}" if c == "{" else "]" for c in reversed(self._stack_at_safe))

    def _take(self, end: int) -> str:
        sent = self._text[:end]
        self._text = self._text[end:]
        self._pos -= end
        self._safe -= end
        return sent

    @property
    def raw_consumed(self) -> str:
        """The model's text this object used (all that was fed, less `rest`)."""
        return self._raw[: len(self._raw) - len(self.rest)]

    def _mark_safe(self, in_string: bool = False) -> None:
        self._safe = self._pos
        self._safe_in_string = in_string
        self._stack_at_safe = list(self._stack)

    def _break(self) -> None:
        self.broken = True
        self.rest = self._text[self._pos :]
        self._text = self._text[: self._pos]

    def _finish(self) -> None:
        self.done = True
        self.rest = self._text[self._pos :]
        self._text = self._text[: self._pos]

    def _scan(self) -> None:
        text = self._text
        while self._pos < len(text) and not self.ended:
            state = self._state
            char = text[self._pos]
            if state in ("string", "key"):
                match = _STRING_STOP.search(text, self._pos)
                if match is None:
                    self._pos = len(text)
                    if state == "string":
                        self._mark_safe(in_string=True)
                    return
                self._pos = match.start()
                char = match.group()
                if char == "\\":
                    if state == "string":
                        self._mark_safe(in_string=True)
                    self._state = "escape"
                    self._pos += 1
                elif char == '"':
                    self._pos += 1
                    if state == "key":
                        self._state = "colon"
                    else:
                        self._after_value()
                else:  # a raw control character: strict JSON rejects it, so send it escaped
                    escaped = _CONTROL_ESCAPES.get(char) or f"\\u{ord(char):04x}"
                    self._text = text = text[: self._pos] + escaped + text[self._pos + 1 :]
                    self._pos += len(escaped)
                    if state == "string":
                        self._mark_safe(in_string=True)
                continue
            if state == "escape":
                if char not in _ESCAPES:
                    self._break()
                    return
                self._pos += 1
                if char == "u":
                    self._hex_left, self._state = 4, "hex"
                else:
                    self._back_to_string()
                continue
            if state == "hex":
                if char not in _HEX:
                    self._break()
                    return
                self._pos += 1
                self._hex_left -= 1
                if self._hex_left == 0:
                    self._back_to_string()
                continue
            if state == "number":
                if char in _NUMBER_CHARS:
                    self._token += char
                    self._pos += 1
                    if _NUMBER.fullmatch(self._token):
                        self._mark_safe()
                    continue
                if not _NUMBER.fullmatch(self._token):
                    self._break()
                    return
                self._after_value()
                continue
            if state == "literal":
                if char != self._literal[len(self._token)]:
                    self._break()
                    return
                self._token += char
                self._pos += 1
                if self._token == self._literal:
                    self._after_value()
                continue
            if char in _WHITESPACE:
                self._pos += 1
                continue
            if not self._structural(state, char):
                self._break()
                return

    def _back_to_string(self) -> None:
        self._state = "key" if self._in_key else "string"
        if not self._in_key:
            self._mark_safe(in_string=True)

    def _structural(self, state: str, char: str) -> bool:
        """One character outside strings; False if JSON does not allow it here."""
        if state == "start":
            if char != "{":
                return False
            self.started = True
            self._open("{")
        elif state == "key_or_end":
            if char == "}":
                self._close()
            elif char == '"':
                self._in_key, self._state = True, "key"
                self._pos += 1
            else:
                return False
        elif state == "colon":
            if char != ":":
                return False
            self._pos += 1
            self._state = "value"
        elif state in ("value", "value_or_end"):
            if char == "]" and state == "value_or_end":
                self._close()
            else:
                return self._value_start(char)
        elif state == "after_value":
            top = self._stack[-1]
            if char == ",":
                self._pos += 1
                self._state = "key_required" if top == "{" else "value"
            elif char in "}]" and char == ("}" if top == "{" else "]"):
                self._close()
            else:
                return False
        elif state == "key_required":
            if char != '"':
                return False
            self._in_key, self._state = True, "key"
            self._pos += 1
        return True

    def _value_start(self, char: str) -> bool:
        if char == '"':
            self._in_key, self._state = False, "string"
            self._pos += 1
            self._mark_safe(in_string=True)
        elif char in "{[":
            self._open(char)
        elif char == "-" or (char.isdigit() and char.isascii()):
            self._state, self._token = "number", ""
        elif char in _LITERALS:
            self._state, self._token, self._literal = "literal", "", _LITERALS[char]
        else:
            return False
        return True

    def _open(self, bracket: str) -> None:
        self._stack.append(bracket)
        self._pos += 1
        self._state = "key_or_end" if bracket == "{" else "value_or_end"
        self._mark_safe()

    def _close(self) -> None:
        self._stack.pop()
        self._pos += 1
        self._after_value()

    def _after_value(self) -> None:
        self._state = "after_value"
        self._mark_safe()
        if not self._stack:
            self._finish()
