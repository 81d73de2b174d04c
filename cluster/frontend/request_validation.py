"""Checks request fields and turns them into engine inputs; every error names its field.

proto3 cannot tell an unset scalar from zero, so the fields whose zero is not their default
are `optional` and read with HasField; an unset one takes the default its comment states.
"""

from __future__ import annotations

import math
from dataclasses import replace

from kvloom.cluster.frontend.errors import InvalidArgument
from kvloom.cluster.frontend.limits import (
    DEFAULT_LIMITS,
    FrontendLimits,
    check_count,
    check_text,
    parse_json,
)
from kvloom.contracts.sampling_params import SamplingParams, StructuredOutputsParams
from kvloom.protos.kvloom.v1 import generation_pb2 as pb

MAX_ID_LENGTH = 256  # request ids and cache salts
MAX_LOGPROBS = 1024  # the engine's own limit
MAX_SEED = 2**63 - 1
MAX_CHOICES = 1024  # structured_outputs.choice


def _float32(value: float) -> float:
    """proto floats are float32: 0.7 arrives as 0.699999988. Seven significant digits give
    back the value the client wrote, so a request samples as the same offline one does."""
    return float(f"{value:.7g}")


def _finite(field: str, value: float) -> float:
    if not math.isfinite(value):
        raise InvalidArgument(field, f"must be a finite number, got {value}")
    return _float32(value)


def check_identifier(field: str, value: str) -> None:
    if len(value) > MAX_ID_LENGTH:
        raise InvalidArgument(field, f"at most {MAX_ID_LENGTH} characters, got {len(value)}")
    if not value.isprintable():
        raise InvalidArgument(field, "must not contain control characters")


def check_request_id(value: str) -> None:
    """Empty means the server assigns one."""
    check_identifier("request_id", value)
    if value and value.strip() != value:
        raise InvalidArgument("request_id", "must not start or end with whitespace")


def check_token_ids(field: str, ids, vocab_size: int) -> None:
    if not ids or max(ids) < vocab_size:  # one pass in C for the usual case
        return
    for i, token_id in enumerate(ids):
        if token_id >= vocab_size:
            raise InvalidArgument(
                field,
                f"token id {token_id} at position {i} is outside the vocabulary [0, {vocab_size})",
            )


def check_prompt_length(num_tokens: int, max_model_len: int) -> None:
    if num_tokens >= max_model_len:
        raise InvalidArgument(
            "prompt",
            f"{num_tokens} tokens, at or over max_model_len ({max_model_len}); it must leave "
            "room for at least one generated token",
        )


def sampling_params(
    msg: pb.SamplingParams,
    vocab_size: int,
    *,
    skip_special_tokens: bool | None = None,
    limits: FrontendLimits = DEFAULT_LIMITS,
) -> SamplingParams:
    """The request's SamplingParams; max_tokens stays None when unset (see `fill_max_tokens`).
    `skip_special_tokens` is the default to use when the request leaves it unset."""
    f = "sampling."
    kwargs: dict = {"max_tokens": None}
    if msg.HasField("max_tokens"):
        if msg.max_tokens < 1:
            raise InvalidArgument(f + "max_tokens", f"must be >= 1, got {msg.max_tokens}")
        kwargs["max_tokens"] = msg.max_tokens
    if msg.min_tokens and kwargs["max_tokens"] is not None and msg.min_tokens > msg.max_tokens:
        raise InvalidArgument(
            f + "min_tokens", f"must be <= max_tokens ({msg.max_tokens}), got {msg.min_tokens}"
        )
    kwargs["min_tokens"] = msg.min_tokens
    if msg.HasField("temperature"):
        value = _finite(f + "temperature", msg.temperature)
        if value < 0:
            raise InvalidArgument(f + "temperature", f"must be >= 0, got {value}")
        kwargs["temperature"] = value
    if msg.HasField("top_p"):
        value = _finite(f + "top_p", msg.top_p)
        if not 0 < value <= 1:
            raise InvalidArgument(f + "top_p", f"must be in (0, 1], got {value}")
        kwargs["top_p"] = value
    if msg.HasField("top_k"):
        if msg.top_k != -1 and msg.top_k < 1:
            raise InvalidArgument(f + "top_k", f"must be -1 (disabled) or >= 1, got {msg.top_k}")
        kwargs["top_k"] = msg.top_k
    min_p = _finite(f + "min_p", msg.min_p)
    if not 0 <= min_p <= 1:
        raise InvalidArgument(f + "min_p", f"must be in [0, 1], got {min_p}")
    kwargs["min_p"] = min_p
    if msg.HasField("seed"):
        if msg.seed > MAX_SEED:
            raise InvalidArgument(f + "seed", f"must be <= {MAX_SEED}, got {msg.seed}")
        kwargs["seed"] = msg.seed
    check_count(f + "stop", len(msg.stop), limits.max_stop_strings, "stop strings")
    for i, stop in enumerate(msg.stop):
        if not stop:
            raise InvalidArgument(f"{f}stop[{i}]", "must not be empty")
        check_text(f"{f}stop[{i}]", stop, limits.max_stop_string_bytes)
    kwargs["stop"] = list(msg.stop)
    check_count(
        f + "stop_token_ids", len(msg.stop_token_ids), limits.max_stop_token_ids, "token ids"
    )
    check_token_ids(f + "stop_token_ids", msg.stop_token_ids, vocab_size)
    kwargs["stop_token_ids"] = list(msg.stop_token_ids)
    kwargs["ignore_eos"] = msg.ignore_eos
    if msg.HasField("logprobs"):
        limit = min(MAX_LOGPROBS, vocab_size)
        if msg.logprobs > limit:
            raise InvalidArgument(f + "logprobs", f"must be <= {limit}, got {msg.logprobs}")
        kwargs["logprobs"] = msg.logprobs
    for name in ("presence_penalty", "frequency_penalty"):
        value = _finite(f + name, getattr(msg, name))
        if not -2 <= value <= 2:
            raise InvalidArgument(f + name, f"must be in [-2, 2], got {value}")
        kwargs[name] = value
    if msg.HasField("repetition_penalty"):
        value = _finite(f + "repetition_penalty", msg.repetition_penalty)
        if value <= 0:
            raise InvalidArgument(f + "repetition_penalty", f"must be > 0, got {value}")
        kwargs["repetition_penalty"] = value
    kwargs["include_stop_str_in_output"] = msg.include_stop_str_in_output
    if msg.HasField("skip_special_tokens"):
        kwargs["skip_special_tokens"] = msg.skip_special_tokens
    elif skip_special_tokens is not None:
        kwargs["skip_special_tokens"] = skip_special_tokens
    if msg.HasField("structured_outputs"):
        kwargs["structured_outputs"] = structured_outputs(msg.structured_outputs, limits)
    try:
        return SamplingParams(**kwargs)
    except ValueError as exc:  # a check above should have caught it first
        raise InvalidArgument(f + str(exc).split(" ", 1)[0], str(exc)) from None


def structured_outputs(
    msg: pb.StructuredOutputs, limits: FrontendLimits = DEFAULT_LIMITS
) -> StructuredOutputsParams:
    """The request's constraint. Whether it compiles is known only when the engine compiles
    it (off its loop): a failure then ends the request with INVALID_ARGUMENT too."""
    f = "sampling.structured_outputs."
    kwargs: dict = {}
    size = limits.max_tool_schema_bytes
    if msg.json:
        check_text(f + "json", msg.json, size)
        kwargs["json"] = parse_json(f + "json", msg.json, limits.max_json_depth)
    for name in ("regex", "grammar"):
        value = getattr(msg, name)
        if value:
            check_text(f + name, value, size)
            kwargs[name] = value
    if msg.choice:
        check_count(f + "choice", len(msg.choice), MAX_CHOICES, "choices")
        for i, choice in enumerate(msg.choice):
            if not choice:
                raise InvalidArgument(f"{f}choice[{i}]", "must not be empty")
            check_text(f"{f}choice[{i}]", choice, size)
        kwargs["choice"] = list(msg.choice)
    if msg.json_object:
        kwargs["json_object"] = True
    try:
        return StructuredOutputsParams(**kwargs)
    except ValueError as exc:
        field = str(exc).split(" ", 1)[0].removesuffix(":")
        raise InvalidArgument("sampling." + field, str(exc)) from None


def fill_max_tokens(params: SamplingParams, prompt_len: int, max_model_len: int) -> SamplingParams:
    """Unset max_tokens: as many as fit in the context after the prompt."""
    if params.max_tokens is not None:
        return params
    return replace(params, max_tokens=max(max_model_len - prompt_len, 1))


def prompt_of(
    request: pb.GenerateRequest,
    vocab_size: int,
    max_model_len: int | None = None,
    limits: FrontendLimits = DEFAULT_LIMITS,
) -> str | list[int]:
    """The text or token ids of a GenerateRequest, not yet tokenized. A text over the byte
    limit and ids past max_model_len are refused before anything reads them through."""
    kind = request.WhichOneof("prompt")
    if kind is None:
        raise InvalidArgument("prompt", "set text or token_ids")
    if kind == "text":
        text = request.text  # each access builds a new str: a 40 MB one costs ~50 ms
        if not text:
            raise InvalidArgument("text", "must not be empty")
        check_text("text", text, limits.for_model_len(max_model_len).max_prompt_bytes)
        return text
    if not request.token_ids.ids:
        raise InvalidArgument("token_ids", "must not be empty")
    if max_model_len is not None:
        check_prompt_length(len(request.token_ids.ids), max_model_len)
    ids = list(request.token_ids.ids)
    check_token_ids("token_ids", ids, vocab_size)
    return ids


def check_abort_ids(ids: list[str] | tuple[str, ...], limits: FrontendLimits = DEFAULT_LIMITS):
    check_count("request_ids", len(ids), limits.max_abort_ids, "request ids")
    for i, request_id in enumerate(ids):
        if not request_id:
            raise InvalidArgument(f"request_ids[{i}]", "must not be empty")
        check_identifier(f"request_ids[{i}]", request_id)


def check_detokenize_ids(ids, vocab_size: int, limits: FrontendLimits = DEFAULT_LIMITS) -> None:
    check_count("token_ids", len(ids), limits.max_detokenize_ids, "token ids")
    check_token_ids("token_ids", ids, vocab_size)


def check_cache_salt(value: str) -> str | None:
    check_identifier("cache_salt", value)
    return value or None
