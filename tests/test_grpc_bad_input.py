"""A table of malformed requests, sent raw over gRPC: each is answered with the right status
and the field it is about (the status details start with `field:`); the server keeps
serving, and a valid request after them succeeds."""

from __future__ import annotations

import grpc
import pytest

from kvloom.cluster.frontend import BackgroundServer, ServerOptions, engine_factory
from kvloom.protos.kvloom.v1 import generation_pb2 as pb
from kvloom.protos.kvloom.v1 import generation_pb2_grpc as pb_grpc

MAX_MODEL_LEN = 64
VOCAB = 512
INVALID = grpc.StatusCode.INVALID_ARGUMENT
TC = pb.ToolChoice
S = pb.SamplingParams


@pytest.fixture(scope="module")
def server(tiny_model):
    model_dir = str(tiny_model("llama"))
    engine = engine_factory(
        model=model_dir, progress=False, max_model_len=MAX_MODEL_LEN, num_kv_blocks=256
    )
    # model_type llama: the llama3_json tool parser by default, and no reasoning parser.
    options = ServerOptions(model=model_dir, host="127.0.0.1", port=0)
    with BackgroundServer(engine, options) as s:
        yield s


@pytest.fixture(scope="module")
def stub(server):
    channel = grpc.insecure_channel(server.address)
    yield pb_grpc.GenerationStub(channel)
    channel.close()


def gen(**kwargs) -> tuple[str, pb.GenerateRequest]:
    kwargs.setdefault("token_ids", pb.TokenIds(ids=[5, 6, 7]))
    if "text" in kwargs or kwargs.get("token_ids") is None:
        kwargs.pop("token_ids")
    return "Generate", pb.GenerateRequest(**kwargs)


def user(content: str = "hi") -> pb.ChatMessage:
    return pb.ChatMessage(role="user", content=content)


def chat(**kwargs) -> tuple[str, pb.ChatRequest]:
    kwargs.setdefault("messages", [user()])
    return "Chat", pb.ChatRequest(**kwargs)


def tool(name: str = "get_weather", parameters: str = '{"type": "object"}') -> pb.Tool:
    return pb.Tool(name=name, parameters=parameters)


def assistant_call(name: str = "f", arguments: str = "{}") -> pb.ChatMessage:
    return pb.ChatMessage(
        role="assistant", tool_calls=[pb.ToolCall(id="c1", name=name, arguments=arguments)]
    )


BAD_REQUESTS = [
    # Generate: the prompt
    ("no prompt", gen(token_ids=None), INVALID, "prompt"),
    ("empty text", gen(text=""), INVALID, "text"),
    ("empty token ids", gen(token_ids=pb.TokenIds()), INVALID, "token_ids"),
    ("token id past vocab", gen(token_ids=pb.TokenIds(ids=[5, VOCAB])), INVALID, "token_ids"),
    ("prompt ids too long", gen(token_ids=pb.TokenIds(ids=[5] * MAX_MODEL_LEN)), INVALID, "prompt"),
    ("prompt text too long", gen(text="word " * 200), INVALID, "prompt"),
    ("request id with newline", gen(request_id="a\nb"), INVALID, "request_id"),
    ("request id too long", gen(request_id="x" * 300), INVALID, "request_id"),
    ("request id padded", gen(request_id=" r1"), INVALID, "request_id"),
    ("cache salt too long", gen(cache_salt="s" * 300), INVALID, "cache_salt"),
    # Generate: sampling
    ("max_tokens 0", gen(sampling=S(max_tokens=0)), INVALID, "sampling.max_tokens"),
    ("negative temperature", gen(sampling=S(temperature=-1)), INVALID, "sampling.temperature"),
    ("NaN temperature", gen(sampling=S(temperature=float("nan"))), INVALID, "sampling.temperature"),
    ("inf temperature", gen(sampling=S(temperature=float("inf"))), INVALID, "sampling.temperature"),
    ("top_p 0", gen(sampling=S(top_p=0.0)), INVALID, "sampling.top_p"),
    ("top_p 1.5", gen(sampling=S(top_p=1.5)), INVALID, "sampling.top_p"),
    ("top_k 0", gen(sampling=S(top_k=0)), INVALID, "sampling.top_k"),
    ("top_k -5", gen(sampling=S(top_k=-5)), INVALID, "sampling.top_k"),
    ("min_p 1.5", gen(sampling=S(min_p=1.5)), INVALID, "sampling.min_p"),
    ("min_p -0.1", gen(sampling=S(min_p=-0.1)), INVALID, "sampling.min_p"),
    ("seed 2**63", gen(sampling=S(seed=2**63)), INVALID, "sampling.seed"),
    ("empty stop string", gen(sampling=S(stop=["ok", ""])), INVALID, "sampling.stop[1]"),
    (
        "stop token past vocab",
        gen(sampling=S(stop_token_ids=[VOCAB])),
        INVALID,
        "sampling.stop_token_ids",
    ),
    ("too many logprobs", gen(sampling=S(logprobs=VOCAB + 1)), INVALID, "sampling.logprobs"),
    (
        "presence penalty 3",
        gen(sampling=S(presence_penalty=3)),
        INVALID,
        "sampling.presence_penalty",
    ),
    (
        "frequency penalty -2.5",
        gen(sampling=S(frequency_penalty=-2.5)),
        INVALID,
        "sampling.frequency_penalty",
    ),
    (
        "repetition penalty 0",
        gen(sampling=S(repetition_penalty=0)),
        INVALID,
        "sampling.repetition_penalty",
    ),
    (
        "min_tokens > max_tokens",
        gen(sampling=S(max_tokens=2, min_tokens=5)),
        INVALID,
        "sampling.min_tokens",
    ),
    # Chat: messages
    ("no messages", chat(messages=[]), INVALID, "messages"),
    ("empty role", chat(messages=[pb.ChatMessage(content="x")]), INVALID, "messages[0].role"),
    (
        "user without content",
        chat(messages=[pb.ChatMessage(role="user")]),
        INVALID,
        "messages[0].content",
    ),
    (
        "assistant with nothing",
        chat(messages=[user(), pb.ChatMessage(role="assistant")]),
        INVALID,
        "messages[1].content",
    ),
    (
        "tool calls from a user",
        chat(
            messages=[pb.ChatMessage(role="user", content="x", tool_calls=[pb.ToolCall(name="f")])]
        ),
        INVALID,
        "messages[0].tool_calls",
    ),
    (
        "tool call arguments not JSON",
        chat(messages=[user(), assistant_call(arguments="{city: Paris}")]),
        INVALID,
        "messages[1].tool_calls[0].arguments",
    ),
    (
        "tool call arguments a JSON list",
        chat(messages=[user(), assistant_call(arguments="[1, 2]")]),
        INVALID,
        "messages[1].tool_calls[0].arguments",
    ),
    (
        "tool call without a name",
        chat(messages=[user(), assistant_call(name="")]),
        INVALID,
        "messages[1].tool_calls[0].name",
    ),
    (
        "tool_call_id on a user message",
        chat(messages=[pb.ChatMessage(role="user", content="x", tool_call_id="c1")]),
        INVALID,
        "messages[0].tool_call_id",
    ),
    (
        "reasoning on a user message",
        chat(messages=[pb.ChatMessage(role="user", content="x", reasoning_content="hmm")]),
        INVALID,
        "messages[0].reasoning_content",
    ),
    # Chat: tools and tool choice
    ("tool without a name", chat(tools=[tool(name="")]), INVALID, "tools[0].name"),
    ("tool name with spaces", chat(tools=[tool(name="get weather")]), INVALID, "tools[0].name"),
    (
        "tool parameters not JSON",
        chat(tools=[tool(parameters="{oops")]),
        INVALID,
        "tools[0].parameters",
    ),
    (
        "tool parameters not an object",
        chat(tools=[tool(parameters='"x"')]),
        INVALID,
        "tools[0].parameters",
    ),
    ("the same tool twice", chat(tools=[tool(), tool()]), INVALID, "tools[1].name"),
    (
        "named tool choice not offered",
        chat(tools=[tool()], tool_choice=TC(mode=TC.TOOL_CHOICE_NAMED, function_name="nope")),
        INVALID,
        "tool_choice.function_name",
    ),
    (
        "required tool choice without tools",
        chat(tool_choice=TC(mode=TC.TOOL_CHOICE_REQUIRED)),
        INVALID,
        "tool_choice.mode",
    ),
    (
        "function name without NAMED",
        chat(tools=[tool()], tool_choice=TC(function_name="get_weather")),
        INVALID,
        "tool_choice.function_name",
    ),
    ("unknown tool choice mode", chat(tool_choice=TC(mode=99)), INVALID, "tool_choice.mode"),
    # Chat: template options and parsing
    (
        "template kwargs not JSON",
        chat(chat_template_kwargs="{enable_thinking: false}"),
        INVALID,
        "chat_template_kwargs",
    ),
    ("template kwargs a list", chat(chat_template_kwargs="[1]"), INVALID, "chat_template_kwargs"),
    (
        "template kwargs replacing messages",
        chat(chat_template_kwargs='{"messages": []}'),
        INVALID,
        "chat_template_kwargs.messages",
    ),
    (
        "continue a user message",
        chat(continue_final_message=True),
        INVALID,
        "continue_final_message",
    ),
    (
        "continue and a generation prompt",
        chat(
            messages=[user(), pb.ChatMessage(role="assistant", content="Sure")],
            continue_final_message=True,
            add_generation_prompt=True,
        ),
        INVALID,
        "continue_final_message",
    ),
    (
        "reasoning asked of a server without a parser",
        chat(parse_reasoning=True),
        INVALID,
        "parse_reasoning",
    ),
    ("chat sampling top_p 0", chat(sampling=S(top_p=0.0)), INVALID, "sampling.top_p"),
    ("chat prompt too long", chat(messages=[user("word " * 100)]), INVALID, "prompt"),
    # unary RPCs
    (
        "detokenize past vocab",
        ("Detokenize", pb.DetokenizeRequest(token_ids=[1, VOCAB])),
        INVALID,
        "token_ids",
    ),
    (
        "abort an empty id",
        ("Abort", pb.AbortRequest(request_ids=["a", ""])),
        INVALID,
        "request_ids[1]",
    ),
    ("render no messages", ("RenderChat", pb.ChatRequest()), INVALID, "messages"),
]


def call(stub, method: str, request) -> list:
    answer = getattr(stub, method)(request, timeout=30)
    return list(answer) if method in ("Generate", "Chat") else [answer]


def test_table_is_big_enough():
    assert len(BAD_REQUESTS) >= 30
    assert len({name for name, *_ in BAD_REQUESTS}) == len(BAD_REQUESTS)


@pytest.mark.parametrize(
    "method, request_message, code, field",
    [(request[0], request[1], code, field) for _, request, code, field in BAD_REQUESTS],
    ids=[entry[0] for entry in BAD_REQUESTS],
)
def test_bad_request_names_the_field(stub, method, request_message, code, field):
    with pytest.raises(grpc.RpcError) as info:
        call(stub, method, request_message)
    assert info.value.code() == code, info.value.details()
    assert info.value.details().startswith(f"{field}:"), info.value.details()


def test_valid_requests_succeed_after_the_bad_ones(stub, server):
    for _, (method, request), _, _ in BAD_REQUESTS:
        with pytest.raises(grpc.RpcError):
            call(stub, method, request)
    responses = call(stub, "Generate", gen(sampling=S(max_tokens=3, temperature=0.0))[1])
    kinds = [r.WhichOneof("kind") for r in responses]
    assert kinds[-2:] == ["finish", "usage"] and kinds.count("delta") >= 1
    assert responses[-1].usage.completion_tokens == 3
    responses = call(stub, "Chat", chat(sampling=S(max_tokens=2))[1])
    assert responses[-1].usage.completion_tokens >= 1
    stats = server.stats()
    assert stats["num_free_blocks"] == stats["num_blocks"] and stats["num_in_flight"] == 0
