"""The bad-request table both front doors are tested with (tests/test_grpc_bad_input.py; an
HTTP door maps the same cases onto its own request shapes).

A case is a request as protobuf's JSON mapping writes it (`fields`, for the RPC `rpc`), the
gRPC status it must get, and the field its message must start with (`field: ...`). A string
that must reach the server as bytes no valid str can hold (invalid UTF-8, an encoded lone
surrogate) is a `RawBytes` marker. The limits the cases test are the server's `LIMITS` and a
model with `MAX_MODEL_LEN` positions, `VOCAB` ids, and a chat template that loops for ever
when `chat_template_kwargs` sets `spin` (`SPIN_TEMPLATE_PREFIX`).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvloom.cluster.frontend.limits import FrontendLimits

MAX_MODEL_LEN = 64
VOCAB = 512
LIMITS = FrontendLimits(
    max_messages=8,
    max_tools=4,
    max_detokenize_ids=1000,
    render_timeout_s=1.5,
)
PROMPT_BYTES = LIMITS.for_model_len(MAX_MODEL_LEN).max_prompt_bytes
# 10^10 iterations: far past any time limit, and a thread running it could never be stopped.
SPIN_TEMPLATE_PREFIX = (
    "{%- if spin is defined %}{%- for i in range(100000) %}{%- for j in range(100000) %}"
    "{%- endfor %}{%- endfor %}{%- endif %}"
)


def spinning_model(src: Path, dst: Path) -> Path:
    """A copy of a model whose chat template loops for ever when asked to (kwarg `spin`)."""
    shutil.copytree(src, dst)
    config_file = dst / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = SPIN_TEMPLATE_PREFIX + config["chat_template"]
    config_file.write_text(json.dumps(config))
    return dst


INVALID = "INVALID_ARGUMENT"
DEADLINE = "DEADLINE_EXCEEDED"


@dataclass(frozen=True)
class RawBytes:
    """A string field's bytes exactly as sent (not valid UTF-8)."""

    data: bytes


SURROGATE = RawBytes(b"\xed\xa0\x80")  # U+D800 encoded as UTF-8 would encode it
BAD_BYTE = RawBytes(b"ok\xff")


@dataclass(frozen=True)
class BadRequest:
    name: str
    rpc: str  # Generate, Chat, RenderChat, Tokenize, Detokenize, Abort
    fields: dict[str, Any]
    code: str  # the gRPC status name
    field: str


def nested(depth: int) -> str:
    """A JSON object nested `depth` levels deep."""
    return '{"a": ' * depth + "1" + "}" * depth


IDS = {"ids": [5, 6, 7]}
USER = {"role": "user", "content": "hi"}


def gen(name: str, code: str, field: str, **fields: Any) -> BadRequest:
    if "text" not in fields:
        fields.setdefault("token_ids", IDS)
    if "token_ids" in fields and fields["token_ids"] is None:
        del fields["token_ids"]
    return BadRequest(name, "Generate", fields, code, field)


def chat(name: str, code: str, field: str, rpc: str = "Chat", **fields: Any) -> BadRequest:
    fields.setdefault("messages", [USER])
    return BadRequest(name, rpc, fields, code, field)


def tool(name: str = "get_weather", parameters: Any = '{"type": "object"}', **more) -> dict:
    return {"name": name, "parameters": parameters, **more}


def assistant_call(name: str = "f", arguments: Any = "{}") -> dict:
    return {"role": "assistant", "tool_calls": [{"id": "c1", "name": name, "arguments": arguments}]}


def user(content: Any) -> dict:
    return {"role": "user", "content": content}


def sampling(**fields: Any) -> dict:
    return {"sampling": fields}


BAD_REQUESTS = [
    # Generate: the prompt
    gen("no prompt", INVALID, "prompt", token_ids=None),
    gen("empty text", INVALID, "text", text=""),
    gen("empty token ids", INVALID, "token_ids", token_ids={}),
    gen("token id past vocab", INVALID, "token_ids", token_ids={"ids": [5, VOCAB]}),
    gen("prompt ids too long", INVALID, "prompt", token_ids={"ids": [5] * MAX_MODEL_LEN}),
    gen("prompt ids far too long", INVALID, "prompt", token_ids={"ids": [5] * 200_000}),
    gen("prompt text too long", INVALID, "prompt", text="word " * 200),
    gen("prompt text over the byte limit", INVALID, "text", text="x" * (PROMPT_BYTES + 1)),
    gen("prompt text a lone surrogate", INVALID, "text", text=SURROGATE),
    gen("prompt text invalid UTF-8", INVALID, "text", text=BAD_BYTE),
    gen("request id with newline", INVALID, "request_id", request_id="a\nb"),
    gen("request id too long", INVALID, "request_id", request_id="x" * 300),
    gen("request id padded", INVALID, "request_id", request_id=" r1"),
    gen("request id invalid UTF-8", INVALID, "request_id", request_id=BAD_BYTE),
    gen("cache salt too long", INVALID, "cache_salt", cache_salt="s" * 300),
    gen("cache salt a lone surrogate", INVALID, "cache_salt", cache_salt=SURROGATE),
    # Generate: sampling
    gen("max_tokens 0", INVALID, "sampling.max_tokens", **sampling(max_tokens=0)),
    gen("negative temperature", INVALID, "sampling.temperature", **sampling(temperature=-1)),
    gen("NaN temperature", INVALID, "sampling.temperature", **sampling(temperature="NaN")),
    gen("inf temperature", INVALID, "sampling.temperature", **sampling(temperature="Infinity")),
    gen("top_p 0", INVALID, "sampling.top_p", **sampling(top_p=0.0)),
    gen("top_p 1.5", INVALID, "sampling.top_p", **sampling(top_p=1.5)),
    gen("top_k 0", INVALID, "sampling.top_k", **sampling(top_k=0)),
    gen("top_k -5", INVALID, "sampling.top_k", **sampling(top_k=-5)),
    gen("min_p 1.5", INVALID, "sampling.min_p", **sampling(min_p=1.5)),
    gen("min_p -0.1", INVALID, "sampling.min_p", **sampling(min_p=-0.1)),
    gen("seed 2**63", INVALID, "sampling.seed", **sampling(seed=str(2**63))),
    gen("empty stop string", INVALID, "sampling.stop[1]", **sampling(stop=["ok", ""])),
    gen("too many stop strings", INVALID, "sampling.stop", **sampling(stop=["s"] * 17)),
    gen("stop string too long", INVALID, "sampling.stop[0]", **sampling(stop=["s" * 513])),
    gen("stop string invalid UTF-8", INVALID, "sampling.stop[1]", **sampling(stop=["a", BAD_BYTE])),
    gen(
        "stop token past vocab",
        INVALID,
        "sampling.stop_token_ids",
        **sampling(stop_token_ids=[VOCAB]),
    ),
    gen(
        "too many stop token ids",
        INVALID,
        "sampling.stop_token_ids",
        **sampling(stop_token_ids=[3] * 1025),
    ),
    gen("too many logprobs", INVALID, "sampling.logprobs", **sampling(logprobs=VOCAB + 1)),
    gen("presence penalty 3", INVALID, "sampling.presence_penalty", **sampling(presence_penalty=3)),
    gen(
        "frequency penalty -2.5",
        INVALID,
        "sampling.frequency_penalty",
        **sampling(frequency_penalty=-2.5),
    ),
    gen(
        "repetition penalty 0",
        INVALID,
        "sampling.repetition_penalty",
        **sampling(repetition_penalty=0),
    ),
    gen(
        "min_tokens > max_tokens",
        INVALID,
        "sampling.min_tokens",
        **sampling(max_tokens=2, min_tokens=5),
    ),
    # Chat: messages
    chat("no messages", INVALID, "messages", messages=[]),
    chat("too many messages", INVALID, "messages", messages=[USER] * 9),
    chat("empty role", INVALID, "messages[0].role", messages=[{"content": "x"}]),
    chat("role invalid UTF-8", INVALID, "messages[0].role", messages=[{"role": BAD_BYTE}]),
    chat("user without content", INVALID, "messages[0].content", messages=[{"role": "user"}]),
    chat(
        "content a lone surrogate",
        INVALID,
        "messages[1].content",
        messages=[USER, user(SURROGATE)],
    ),
    chat(
        "chat text over the byte limit",
        INVALID,
        "messages[1].content",
        messages=[user("x" * (PROMPT_BYTES // 2)), user("y" * (PROMPT_BYTES // 2 + 1))],
    ),
    chat(
        "assistant with nothing",
        INVALID,
        "messages[1].content",
        messages=[USER, {"role": "assistant"}],
    ),
    chat(
        "tool calls from a user",
        INVALID,
        "messages[0].tool_calls",
        messages=[{"role": "user", "content": "x", "tool_calls": [{"name": "f"}]}],
    ),
    chat(
        "tool call arguments not JSON",
        INVALID,
        "messages[1].tool_calls[0].arguments",
        messages=[USER, assistant_call(arguments="{city: Paris}")],
    ),
    chat(
        "tool call arguments a JSON list",
        INVALID,
        "messages[1].tool_calls[0].arguments",
        messages=[USER, assistant_call(arguments="[1, 2]")],
    ),
    chat(
        "tool call arguments nested 70 deep",
        INVALID,
        "messages[1].tool_calls[0].arguments",
        messages=[USER, assistant_call(arguments=nested(70))],
    ),
    chat(
        "tool call arguments nested 5000 deep",
        INVALID,
        "messages[1].tool_calls[0].arguments",
        messages=[USER, assistant_call(arguments=nested(5000))],
    ),
    chat(
        "tool call arguments invalid UTF-8",
        INVALID,
        "messages[1].tool_calls[0].arguments",
        messages=[USER, assistant_call(arguments=BAD_BYTE)],
    ),
    chat(
        "tool call without a name",
        INVALID,
        "messages[1].tool_calls[0].name",
        messages=[USER, assistant_call(name="")],
    ),
    chat(
        "tool_call_id on a user message",
        INVALID,
        "messages[0].tool_call_id",
        messages=[{"role": "user", "content": "x", "tool_call_id": "c1"}],
    ),
    chat(
        "reasoning on a user message",
        INVALID,
        "messages[0].reasoning_content",
        messages=[{"role": "user", "content": "x", "reasoning_content": "hmm"}],
    ),
    # Chat: tools and tool choice
    chat("tool without a name", INVALID, "tools[0].name", tools=[tool(name="")]),
    chat("tool name with spaces", INVALID, "tools[0].name", tools=[tool(name="get weather")]),
    chat("too many tools", INVALID, "tools", tools=[tool(name=f"t{i}") for i in range(5)]),
    chat(
        "tool parameters not JSON", INVALID, "tools[0].parameters", tools=[tool(parameters="{oops")]
    ),
    chat(
        "tool parameters not an object",
        INVALID,
        "tools[0].parameters",
        tools=[tool(parameters='"x"')],
    ),
    chat(
        "tool parameters nested 70 deep",
        INVALID,
        "tools[0].parameters",
        tools=[tool(parameters=nested(70))],
    ),
    chat(
        "tool parameters nested 100000 deep",
        INVALID,
        "tools[0].parameters",
        tools=[tool(parameters=nested(100_000))],
    ),
    chat(
        "tool parameters over the schema limit",
        INVALID,
        "tools[0].parameters",
        tools=[tool(parameters='{"description": "' + "d" * LIMITS.max_tool_schema_bytes + '"}')],
    ),
    chat(
        "tool parameters invalid UTF-8",
        INVALID,
        "tools[0].parameters",
        tools=[tool(parameters=SURROGATE)],
    ),
    chat(
        "tool description invalid UTF-8",
        INVALID,
        "tools[0].description",
        tools=[tool(description=BAD_BYTE)],
    ),
    chat("the same tool twice", INVALID, "tools[1].name", tools=[tool(), tool()]),
    chat(
        "named tool choice not offered",
        INVALID,
        "tool_choice.function_name",
        tools=[tool()],
        tool_choice={"mode": "TOOL_CHOICE_NAMED", "function_name": "nope"},
    ),
    chat(
        "required tool choice without tools",
        INVALID,
        "tool_choice.mode",
        tool_choice={"mode": "TOOL_CHOICE_REQUIRED"},
    ),
    chat(
        "function name without NAMED",
        INVALID,
        "tool_choice.function_name",
        tools=[tool()],
        tool_choice={"function_name": "get_weather"},
    ),
    chat("unknown tool choice mode", INVALID, "tool_choice.mode", tool_choice={"mode": 99}),
    # Chat: template options and parsing
    chat(
        "template kwargs not JSON",
        INVALID,
        "chat_template_kwargs",
        chat_template_kwargs="{enable_thinking: false}",
    ),
    chat("template kwargs a list", INVALID, "chat_template_kwargs", chat_template_kwargs="[1]"),
    chat(
        "template kwargs nested 70 deep",
        INVALID,
        "chat_template_kwargs",
        chat_template_kwargs=nested(70),
    ),
    chat(
        "template kwargs nested 5000 deep",
        INVALID,
        "chat_template_kwargs",
        chat_template_kwargs=nested(5000),
    ),
    chat(
        "template kwargs over the size limit",
        INVALID,
        "chat_template_kwargs",
        chat_template_kwargs='{"x": "' + "x" * LIMITS.max_template_kwargs_bytes + '"}',
    ),
    chat(
        "template kwargs invalid UTF-8",
        INVALID,
        "chat_template_kwargs",
        chat_template_kwargs=SURROGATE,
    ),
    chat(
        "template kwargs replacing messages",
        INVALID,
        "chat_template_kwargs.messages",
        chat_template_kwargs='{"messages": []}',
    ),
    chat("continue a user message", INVALID, "continue_final_message", continue_final_message=True),
    chat(
        "continue and a generation prompt",
        INVALID,
        "continue_final_message",
        messages=[USER, {"role": "assistant", "content": "Sure"}],
        continue_final_message=True,
        add_generation_prompt=True,
    ),
    chat(
        "reasoning asked of a server without a parser",
        INVALID,
        "parse_reasoning",
        parse_reasoning=True,
    ),
    chat("chat sampling top_p 0", INVALID, "sampling.top_p", **sampling(top_p=0.0)),
    chat("chat prompt too long", INVALID, "prompt", messages=[user("word " * 100)]),
    chat(
        "a template that never ends",
        DEADLINE,
        "messages",
        chat_template_kwargs='{"spin": true}',
    ),
    # unary RPCs
    BadRequest(
        "detokenize past vocab", "Detokenize", {"token_ids": [1, VOCAB]}, INVALID, "token_ids"
    ),
    BadRequest(
        "detokenize too many ids", "Detokenize", {"token_ids": [1] * 1001}, INVALID, "token_ids"
    ),
    BadRequest("tokenize invalid UTF-8", "Tokenize", {"text": SURROGATE}, INVALID, "text"),
    BadRequest(
        "tokenize over the byte limit",
        "Tokenize",
        {"text": "x" * (PROMPT_BYTES + 1)},
        INVALID,
        "text",
    ),
    BadRequest("abort an empty id", "Abort", {"request_ids": ["a", ""]}, INVALID, "request_ids[1]"),
    BadRequest(
        "abort an invalid UTF-8 id",
        "Abort",
        {"request_ids": ["a", BAD_BYTE]},
        INVALID,
        "request_ids[1]",
    ),
    BadRequest(
        "abort too many ids", "Abort", {"request_ids": ["a"] * 1025}, INVALID, "request_ids"
    ),
    chat("render no messages", INVALID, "messages", rpc="RenderChat", messages=[]),
    chat(
        "render content invalid UTF-8",
        INVALID,
        "messages[0].content",
        rpc="RenderChat",
        messages=[user(BAD_BYTE)],
    ),
    chat(
        "render a template that never ends",
        DEADLINE,
        "messages",
        rpc="RenderChat",
        chat_template_kwargs='{"spin": true}',
    ),
]
