"""Mistral tool calls, both tokenizer generations:

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {...}]   (before v11)
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}    (v11+)
    [TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Paris"}            (with ids)

    [TOOL_CALLS]{"name": "get_weather", "arguments": {...}}                      (seen too)

Mistral's templates require 9-character alphanumeric call ids, so generated ids have that
shape. `[TOOL_CALLS]` followed by anything else (prose, a name that is no offered tool,
arguments that are not a JSON object) is content, marker included.
"""

from __future__ import annotations

import re
import secrets
import string

from kvloom.cluster.parsers.json_object_stream import JsonObjectStreamer
from kvloom.cluster.parsers.tool_calls.base import ToolCallParser

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"
_NAME = re.compile(r"\s*[\w.\-: ]*")  # spaces: a name such as `get weather` may resolve
_MAX_NAME = 256
_ALPHANUMERIC = string.ascii_letters + string.digits


def mistral_call_id(index: int) -> str:
    return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(9))


class MistralToolParser(ToolCallParser):
    name = "mistral"
    start_markers = (TOOL_CALLS,)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._state = "content"
        self._raw: list[str] = []  # text since [TOOL_CALLS] while it may still not be a call
        self._name = ""
        self._call_id: list[str] = []
        self._arguments = JsonObjectStreamer()
        self._reader = self._call_object_reader()
        self._bare = False  # a call object right after the marker, not in an array

    @staticmethod
    def default_call_id(index: int) -> str:
        return mistral_call_id(index)

    def _step(self) -> bool:
        return getattr(self, "_state_" + self._state)()

    def _give_back(self) -> bool:
        self._emit_content("".join(self._raw))
        self._raw = []
        self._state = "content"
        return True

    def _state_content(self) -> bool:
        text, marker = self._take_until((TOOL_CALLS,))
        self._emit_content(text)
        if marker is None:
            return False
        self._raw = [marker]
        self._state = "after_marker"
        return True

    def _state_after_marker(self) -> bool:
        stripped = self._buf.lstrip()
        if not stripped:
            return self._give_back() if self._eof else False
        self._raw.append(self._consume(len(self._buf) - len(stripped)))
        if stripped[0] == "[":
            self._raw.append(self._consume(1))
            self._bare = False
            self._state = "array"
        elif stripped[0] == "{":
            self._bare = True
            self._reader = self._call_object_reader()
            self._state = "object"
        else:
            self._state = "name"
        return True

    # ----- v11+: NAME[CALL_ID]id[ARGS]{json}

    def _state_name(self) -> bool:
        pos = min(
            (p for p in (self._buf.find(ARGS), self._buf.find(CALL_ID)) if p >= 0), default=-1
        )
        candidate = self._buf if pos < 0 else self._buf[:pos]
        if pos < 0:
            # Hold a possible partial marker; the rest must look like a name.
            for size in range(min(len(candidate), len(CALL_ID) - 1), 0, -1):
                if ARGS.startswith(candidate[-size:]) or CALL_ID.startswith(candidate[-size:]):
                    candidate = candidate[:-size]
                    break
        if not _NAME.fullmatch(candidate) or len(candidate) > _MAX_NAME:
            return self._give_back()
        if pos < 0:
            return self._give_back() if self._eof else False
        name = self._resolve_name(candidate)
        if name is None:
            return self._give_back()
        self._name = name
        self._raw.append(self._consume(pos))
        if self._buf.startswith(CALL_ID):
            self._raw.append(self._consume(len(CALL_ID)))
            self._call_id = []
            self._state = "call_id"
        else:
            self._raw.append(self._consume(len(ARGS)))
            self._call_id = []
            self._state = "before_arguments"
        return True

    def _state_call_id(self) -> bool:
        text, marker = self._take_until((ARGS,))
        self._call_id.append(text)
        self._raw.append(text)
        if marker is None:
            return self._give_back() if self._eof else False
        self._raw.append(marker)
        self._state = "before_arguments"
        return True

    def _state_before_arguments(self) -> bool:
        """The call starts only if its arguments are a JSON object."""
        stripped = self._buf.lstrip()
        if not stripped:
            return self._give_back() if self._eof else False
        if stripped[0] != "{":
            return self._give_back()
        self._buf = stripped
        self._raw = []
        self._start_call(self._name, "".join(self._call_id).strip() or None)
        self._arguments = JsonObjectStreamer()
        self._state = "arguments"
        return True

    def _state_arguments(self) -> bool:
        if not self._buf and not self._eof:
            return False
        self._emit_arguments(self._arguments.feed(self._consume(len(self._buf)), self._eof))
        if not self._arguments.ended:
            return False
        self._buf = self._arguments.rest + self._buf
        self._close_call()
        self._state = "content"
        return True

    # ----- before v11: [{"name": ..., "arguments": {...}}, ...]

    def _state_array(self) -> bool:
        stripped = self._buf.lstrip()
        self._raw.append(self._consume(len(self._buf) - len(stripped)))
        if not stripped:
            return False
        char = self._buf[0]
        if char == "{":
            self._reader = self._call_object_reader()
            self._state = "object"
        elif char == ",":
            self._raw.append(self._consume(1))
        elif char == "]":
            self._consume(1)
            self._raw = []
            self._state = "content"
        elif self._raw:  # no call read from this array yet
            return self._give_back()
        else:
            self._state = "content"
        return True

    def _state_object(self) -> bool:
        reader = self._reader
        if not self._feed_call_object(reader):
            return False
        if not reader.committed:
            self._raw.append(reader.consumed)
            return self._give_back()
        self._raw = []  # committed: this was a call
        self._close_call()
        self._state = "array" if reader.done and not self._bare else "content"
        return True
