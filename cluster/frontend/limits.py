"""The front door's size limits on request fields, and the checks that enforce them before any
costly work (a prompt's bytes are counted before it is tokenized, JSON nesting before it is
parsed). Every limit is documented in docs/grpc.md; every refusal is INVALID_ARGUMENT naming
the field."""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, replace

from kvloom.cluster.frontend.errors import InvalidArgument

KIB = 1024
# A prompt may be at most this many bytes per position of max_model_len. Tokenizers average
# 3-5 bytes a token on text and code; 32 leaves room for long single-token runs (indentation,
# repeated characters) while a 40 MB prompt on a 4096-position model is refused unread.
PROMPT_BYTES_PER_POSITION = 32
MIN_PROMPT_BYTES = 64 * KIB  # the limit for small max_model_len (and before the engine loads)
UNKNOWN_LEN_PROMPT_BYTES = 4 * 1024 * KIB  # while the engine's max_model_len is not known yet


@dataclass(frozen=True)
class FrontendLimits:
    # Text prompts (Generate.text, Tokenize.text), and a chat's messages plus tool schemas in
    # all. None: PROMPT_BYTES_PER_POSITION x max_model_len, at least MIN_PROMPT_BYTES.
    max_prompt_bytes: int | None = None
    max_messages: int = 4096
    max_tools: int = 256
    max_tool_schema_bytes: int = 64 * KIB  # one tool's parameters (JSON Schema text)
    max_template_kwargs_bytes: int = 64 * KIB
    max_json_depth: int = 64  # nesting of tools[].parameters, arguments, chat_template_kwargs
    max_stop_strings: int = 16
    max_stop_string_bytes: int = 512
    max_stop_token_ids: int = 1024
    max_detokenize_ids: int = 1 << 20
    max_abort_ids: int = 1024
    # Tokenizing or rendering one request may take this long in the render pool; past it the
    # worker is killed (and replaced) and the request fails DEADLINE_EXCEEDED.
    render_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        for name, value in self.__dict__.items():
            if value is None and name == "max_prompt_bytes":
                continue
            if name == "render_timeout_s":  # a bound, so never infinite
                ok = isinstance(value, int | float) and math.isfinite(value) and value > 0
                what = "a finite number of seconds > 0"
            else:
                ok = isinstance(value, int) and value > 0
                what = "an integer > 0"
            if not ok or isinstance(value, bool):
                raise ValueError(f"limits.{name} must be {what}, got {value!r}")

    def for_model_len(self, max_model_len: int | None) -> FrontendLimits:
        """These limits with max_prompt_bytes resolved for the engine's max_model_len."""
        if self.max_prompt_bytes is not None:
            return self
        return _resolved(self, max_model_len)


@functools.lru_cache(maxsize=64)  # once per server, not once per request
def _resolved(limits: FrontendLimits, max_model_len: int | None) -> FrontendLimits:
    if max_model_len is None:
        return replace(limits, max_prompt_bytes=UNKNOWN_LEN_PROMPT_BYTES)
    size = max(MIN_PROMPT_BYTES, PROMPT_BYTES_PER_POSITION * int(max_model_len))
    return replace(limits, max_prompt_bytes=size)


DEFAULT_LIMITS = FrontendLimits().for_model_len(None)


def utf8_size(text: str, limit: int) -> int:
    """The UTF-8 size of `text`, or some number over `limit` once it is surely over (a huge
    text is never encoded just to be refused). A lone surrogate (possible in text that came
    from JSON) raises UnicodeEncodeError."""
    if len(text) > limit:
        return len(text)  # at least one byte a character
    if text.isascii():
        return len(text)
    return len(text.encode("utf-8"))


def check_text(field: str, text: str, limit: int | None = None) -> None:
    """Valid Unicode (no lone surrogates) and at most `limit` UTF-8 bytes."""
    try:
        size = utf8_size(text, limit if limit is not None else 4 * len(text))
    except UnicodeEncodeError as exc:
        raise InvalidArgument(
            field, f"is not valid Unicode: a lone surrogate at character {exc.start}"
        ) from None
    if limit is not None and size > limit:
        raise InvalidArgument(field, f"too large: over {limit} bytes (the server's limit)")


def check_count(field: str, count: int, limit: int, what: str) -> None:
    if count > limit:
        raise InvalidArgument(field, f"at most {limit} {what}, got {count}")


def parse_json(field: str, text: str, max_depth: int) -> object:
    """json.loads, with nesting deeper than max_depth refused (templates and their filters
    recurse once per level). The parser itself stops at Python's recursion limit with a
    RecursionError, which is the request's fault like any other bad JSON."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise InvalidArgument(field, f"JSON nested deeper than {max_depth} levels") from None
    except ValueError as exc:
        raise InvalidArgument(field, f"not valid JSON: {exc}") from None
    if json_depth(value) > max_depth:
        raise InvalidArgument(field, f"JSON nested deeper than {max_depth} levels")
    return value


def json_depth(value: object) -> int:
    """Nesting depth of parsed JSON (a scalar is 0, [] and {} are 1), without recursion."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            item = item.values()
        elif not isinstance(item, list):
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in item if isinstance(child, dict | list))
    return deepest
