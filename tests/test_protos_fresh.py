"""The committed gRPC stubs match the .proto, import under kvloom.protos, and work end to end."""

from __future__ import annotations

import pickle
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from kvloom.protos import generate
from kvloom.protos.kvloom.v1 import generation_pb2 as pb
from kvloom.protos.kvloom.v1 import generation_pb2_grpc as pb_grpc

PROTOS = Path(generate.__file__).resolve().parent


def test_committed_stubs_are_fresh(tmp_path: Path) -> None:
    written = generate.generate(tmp_path)
    assert written, "protoc wrote nothing"
    for path in written:
        relative = path.relative_to(tmp_path)
        committed = PROTOS / relative
        assert committed.is_file(), f"{relative} is not committed; run python protos/generate.py"
        assert committed.read_text(encoding="utf-8") == path.read_text(encoding="utf-8"), (
            f"{relative} is stale; run python protos/generate.py"
        )


def test_stubs_import_from_kvloom_protos_and_keep_the_wire_names() -> None:
    assert pb.DESCRIPTOR.package == "kvloom.v1"
    assert pb.DESCRIPTOR.name == "kvloom/v1/generation.proto"
    assert pb.ChatRequest.__module__ == "kvloom.protos.kvloom.v1.generation_pb2"
    request = pb.ChatRequest(messages=[pb.ChatMessage(role="user", content="hi")])
    assert pickle.loads(pickle.dumps(request)) == request  # pickle finds the module
    assert set(pb.DESCRIPTOR.services_by_name["Generation"].methods_by_name) == {
        "Generate",
        "Chat",
        "Abort",
        "Tokenize",
        "Detokenize",
        "RenderChat",
        "GetModelInfo",
        "GetServerInfo",
    }


# Fields whose proto3 zero is not the real default must track presence.
@pytest.mark.parametrize(
    "message,fields",
    [
        (
            pb.SamplingParams,
            [
                "max_tokens",
                "temperature",
                "top_p",
                "top_k",
                "seed",
                "logprobs",
                "repetition_penalty",
                "skip_special_tokens",
            ],
        ),
        (pb.ChatRequest, ["add_generation_prompt", "parse_reasoning"]),
        (pb.ChatMessage, ["content", "reasoning_content"]),
        (pb.ToolCallDelta, ["id", "name"]),
        (pb.GenerateRequest, ["add_special_tokens"]),
        (pb.TokenizeRequest, ["add_special_tokens"]),
        (pb.DetokenizeRequest, ["skip_special_tokens"]),
    ],
)
def test_fields_with_non_zero_defaults_are_optional(message, fields) -> None:
    descriptor = message.DESCRIPTOR
    for name in fields:
        assert descriptor.fields_by_name[name].has_presence, f"{descriptor.name}.{name}"
    instance = message()
    assert not any(instance.HasField(name) for name in fields)


def test_sampling_zero_values_are_distinguishable_from_unset() -> None:
    params = pb.SamplingParams(temperature=0.0, top_k=0)
    decoded = pb.SamplingParams.FromString(params.SerializeToString())
    assert decoded.HasField("temperature") and decoded.temperature == 0.0
    assert not decoded.HasField("top_p")


class _EchoServicer(pb_grpc.GenerationServicer):
    def Generate(self, request, context):
        for char in request.text:
            yield pb.GenerateResponse(
                request_id=request.request_id, delta=pb.GenerateDelta(text=char)
            )
        yield pb.GenerateResponse(
            request_id=request.request_id,
            finish=pb.Finish(reason=pb.FINISH_REASON_STOP, stop_str="."),
        )
        yield pb.GenerateResponse(
            request_id=request.request_id, usage=pb.Usage(completion_tokens=len(request.text))
        )

    def Abort(self, request, context):
        return pb.AbortResponse(aborted_request_ids=list(request.request_ids))


def test_generated_service_runs_over_a_real_channel() -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_GenerationServicer_to_server(_EchoServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.GenerationStub(channel)
            responses = list(stub.Generate(pb.GenerateRequest(request_id="r1", text="héllo😀")))
            kinds = [r.WhichOneof("kind") for r in responses]
            assert kinds == ["delta"] * 6 + ["finish", "usage"]
            assert "".join(r.delta.text for r in responses[:6]) == "héllo😀"
            assert responses[-2].finish.WhichOneof("matched_stop") == "stop_str"
            aborted = stub.Abort(pb.AbortRequest(request_ids=["a", "b"]))
            assert list(aborted.aborted_request_ids) == ["a", "b"]
            with pytest.raises(grpc.RpcError) as info:
                stub.Tokenize(pb.TokenizeRequest(text="x"))
            assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        server.stop(None)
