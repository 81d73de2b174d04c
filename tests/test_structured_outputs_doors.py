"""Structured outputs through the doors: gRPC's `SamplingParams.structured_outputs` and the
HTTP door's `response_format` (`json_schema`, `json_object`) with the real clients, on a
tiny random-weight model; a constraint that does not compile is INVALID_ARGUMENT naming it,
and the server keeps serving."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from kvloom.client import Client, ServerError, collect
from kvloom.cluster.frontend import BackgroundServer, ServerOptions, engine_factory

ENGINE = dict(dtype="float32", block_size=4, max_model_len=256, num_kv_blocks=512)
SCHEMA = {
    "type": "object",
    "properties": {
        "kind": {"enum": ["cat", "dog"]},
        "legs": {"type": "integer", "minimum": 0, "maximum": 8},
        "owner": {
            "type": "object",
            "properties": {"name": {"enum": ["ann", "bo"]}},
            "required": ["name"],
            "additionalProperties": False,
        },
    },
    "required": ["kind", "legs", "owner"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Describe a pet."}]
MODEL = "tiny"


@pytest.fixture(scope="module")
def server(tiny_model):
    model_dir = str(tiny_model("llama"))
    options = ServerOptions(
        model=model_dir, host="127.0.0.1", port=0, http_port=0, served_model_name=MODEL
    )
    with BackgroundServer(engine_factory(model=model_dir, progress=False, **ENGINE), options) as s:
        yield s


@pytest.fixture(scope="module")
def grpc_client(server):
    with Client(server.address, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def oai(server):
    base_url = f"http://127.0.0.1:{server.server.http_port}/v1"
    with openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
        yield client


def test_grpc_json_regex_and_choice(grpc_client):
    for seed in range(3):
        out = collect(
            grpc_client.generate(
                "hi", max_tokens=64, seed=seed, structured_outputs={"json": SCHEMA}
            )
        )
        assert out.finish_reason == "stop", out
        jsonschema.validate(json.loads(out.text), SCHEMA)
        out = collect(
            grpc_client.generate(
                "hi", max_tokens=32, seed=seed, structured_outputs={"regex": r"\d{3}-[xy]+"}
            )
        )
        assert re.fullmatch(r"\d{3}-[xy]+", out.text), out.text
        out = collect(
            grpc_client.generate(
                "hi", max_tokens=16, seed=seed, structured_outputs={"choice": ["left", "right"]}
            )
        )
        assert out.text in ("left", "right")


def test_grpc_bad_constraints_are_invalid_argument_naming_the_field(grpc_client):
    with pytest.raises(ServerError) as err:
        collect(grpc_client.generate("hi", max_tokens=8, structured_outputs={"regex": "(("}))
    assert err.value.code.name == "INVALID_ARGUMENT"
    assert "structured_outputs.regex" in err.value.details
    with pytest.raises(ServerError) as err:
        collect(grpc_client.generate("hi", max_tokens=8, structured_outputs={"json": "{oops"}))
    assert err.value.code.name == "INVALID_ARGUMENT"
    assert "sampling.structured_outputs.json" in err.value.details
    with pytest.raises(ServerError) as err:
        collect(
            grpc_client.generate(
                "hi", max_tokens=8, structured_outputs={"regex": "a", "choice": ["b"]}
            )
        )
    assert err.value.code.name == "INVALID_ARGUMENT"
    assert "structured_outputs" in err.value.details
    # The server still serves.
    assert collect(grpc_client.generate("hi", max_tokens=3, ignore_eos=True)).finish_reason


def test_http_response_format_json_schema_and_json_object(oai):
    for seed in range(3):
        reply = oai.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=64,
            seed=seed,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True},
            },
        )
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    reply = oai.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=8,
        seed=0,
        response_format={"type": "json_object"},
    )
    assert reply.choices[0].message.content.startswith("{")
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=8,
            response_format={"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}},
        )
    assert "structured_outputs.json" in str(err.value)
