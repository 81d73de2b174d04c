"""The bad-request table (tests/bad_requests.py) sent raw over gRPC: each case is answered
with its status and the field it is about (the status details start with `field:`), invalid
UTF-8 included; afterwards the server still answers a normal request exactly as before, and
its KV pool and render pool are full."""

from __future__ import annotations

import time

import grpc
import pytest
from google.protobuf import json_format

from kvloom.cluster.frontend import BackgroundServer, ServerOptions, engine_factory
from kvloom.protos.kvloom.v1 import generation_pb2 as pb
from tests.bad_requests import (
    BAD_REQUESTS,
    LIMITS,
    MAX_MODEL_LEN,
    BadRequest,
    RawBytes,
    spinning_model,
)

REQUEST_TYPES = {
    "Generate": pb.GenerateRequest,
    "Chat": pb.ChatRequest,
    "RenderChat": pb.ChatRequest,
    "Tokenize": pb.TokenizeRequest,
    "Detokenize": pb.DetokenizeRequest,
    "Abort": pb.AbortRequest,
}
RESPONSE_TYPES = {
    "Generate": pb.GenerateResponse,
    "Chat": pb.ChatResponse,
    "RenderChat": pb.RenderChatResponse,
    "Tokenize": pb.TokenizeResponse,
    "Detokenize": pb.DetokenizeResponse,
    "Abort": pb.AbortResponse,
}
STREAMING = ("Generate", "Chat")


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    model_dir = str(spinning_model(tiny_model("llama"), tmp_path_factory.mktemp("m") / "m"))
    engine = engine_factory(
        model=model_dir, progress=False, max_model_len=MAX_MODEL_LEN, num_kv_blocks=256
    )
    # A llama model with the demo's Hermes template: the hermes tool parser, no reasoning.
    options = ServerOptions(model=model_dir, host="127.0.0.1", port=0, limits=LIMITS)
    with BackgroundServer(engine, options) as s:
        yield s


@pytest.fixture(scope="module")
def channel(server):
    channel = grpc.insecure_channel(server.address)
    yield channel
    channel.close()


def _replace_raw(value, found: list):
    """The request dict with each RawBytes replaced by a same-length placeholder string."""
    if isinstance(value, RawBytes):
        placeholder = "".join(chr(1 + (len(found) + i) % 30) for i in range(len(value.data)))
        found.append((placeholder.encode(), value.data))
        return placeholder
    if isinstance(value, dict):
        return {k: _replace_raw(v, found) for k, v in value.items()}
    if isinstance(value, list):
        return [_replace_raw(v, found) for v in value]
    return value


def serialize(case: BadRequest) -> bytes:
    """The case's request on the wire; RawBytes go in as the bytes they hold (each
    placeholder has their length, so every length prefix stays right)."""
    found: list = []
    fields = _replace_raw(case.fields, found)
    data = json_format.ParseDict(fields, REQUEST_TYPES[case.rpc]()).SerializeToString()
    for placeholder, raw in found:
        assert data.count(placeholder) == 1, case.name
        data = data.replace(placeholder, raw)
    return data


def call_raw(channel, rpc: str, data: bytes, timeout: float = 30) -> list:
    path = f"/kvloom.v1.Generation/{rpc}"
    decode = RESPONSE_TYPES[rpc].FromString
    if rpc in STREAMING:
        return list(channel.unary_stream(path, response_deserializer=decode)(data, timeout=timeout))
    return [channel.unary_unary(path, response_deserializer=decode)(data, timeout=timeout)]


def greedy_generate(channel) -> list[int]:
    request = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=[5, 6, 7]),
        sampling=pb.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
    )
    responses = call_raw(channel, "Generate", request.SerializeToString())
    assert responses[-2].WhichOneof("kind") == "finish"
    return [t for r in responses if r.WhichOneof("kind") == "delta" for t in r.delta.token_ids]


@pytest.fixture(scope="module")
def reference_tokens(channel) -> list[int]:
    """The greedy answer before any bad request arrived."""
    return greedy_generate(channel)


def test_table_is_big_enough():
    assert len(BAD_REQUESTS) >= 60
    assert len({case.name for case in BAD_REQUESTS}) == len(BAD_REQUESTS)
    assert {case.rpc for case in BAD_REQUESTS} == set(REQUEST_TYPES)


@pytest.mark.parametrize("case", BAD_REQUESTS, ids=[case.name for case in BAD_REQUESTS])
def test_bad_request_names_the_field(channel, reference_tokens, case):
    data = serialize(case)
    begun = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        call_raw(channel, case.rpc, data)
    elapsed = time.monotonic() - begun
    assert info.value.code() == getattr(grpc.StatusCode, case.code), info.value.details()
    assert info.value.details().startswith(f"{case.field}:"), info.value.details()
    # Refused before any costly work; a render stopped at the server's time limit.
    limit = LIMITS.render_timeout_s + 2.0 if case.code == "DEADLINE_EXCEEDED" else 2.0
    assert elapsed < limit, (case.name, elapsed)


def wait_for_full_render_pool(server, timeout_s: float = 30.0) -> dict:
    pool = server.server.render_pool
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats = pool.stats()
        if stats["alive"] == stats["idle"] == stats["size"]:
            return stats
        time.sleep(0.1)
    raise AssertionError(f"the render pool is not full again: {pool.stats()}")


def test_a_normal_request_is_right_after_the_bad_ones(channel, server, reference_tokens):
    for case in BAD_REQUESTS:
        with pytest.raises(grpc.RpcError):
            call_raw(channel, case.rpc, serialize(case))
    assert greedy_generate(channel) == reference_tokens
    chat = pb.ChatRequest(
        messages=[pb.ChatMessage(role="user", content="hi")],
        sampling=pb.SamplingParams(max_tokens=2),
    )
    responses = call_raw(channel, "Chat", chat.SerializeToString())
    assert responses[-1].usage.completion_tokens >= 1
    stats = server.stats()
    assert stats["num_free_blocks"] == stats["num_blocks"] and stats["num_in_flight"] == 0
    pool = wait_for_full_render_pool(server)
    assert pool["replaced"] >= 2  # the spinning renders' workers were killed and replaced


def test_tiny_temperature_is_greedy_through_the_front_door(channel, reference_tokens):
    """temperature=1e-40 (float32 denormal on the wire) samples greedily, as vLLM's < 1e-5."""
    request = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=[5, 6, 7]),
        sampling=pb.SamplingParams(max_tokens=6, temperature=1e-40, ignore_eos=True, seed=1),
    )
    responses = call_raw(channel, "Generate", request.SerializeToString())
    tokens = [t for r in responses if r.WhichOneof("kind") == "delta" for t in r.delta.token_ids]
    assert tokens == reference_tokens


def test_a_llama_with_a_hermes_template_gets_the_hermes_parser(channel):
    """The demo model (model_type llama, a ChatML template writing Hermes <tool_call>s) is
    served with the parser its template writes, not Llama 3's JSON one."""
    info = pb.ModelInfo.FromString(
        channel.unary_unary("/kvloom.v1.Generation/GetModelInfo")(
            pb.GetModelInfoRequest().SerializeToString(), timeout=30
        )
    )
    assert info.model_type == "llama" and info.tool_call_parser == "hermes"
