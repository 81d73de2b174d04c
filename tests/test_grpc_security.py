"""Transport options over real gRPC: a bearer token guards every RPC but health; TLS with
a self-signed certificate (made by the openssl CLI); message size limits; reflection."""

from __future__ import annotations

import grpc
import pytest
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from kvloom.client import Client, ServerError, collect
from kvloom.cluster.frontend import BackgroundServer, ServerOptions, engine_factory

TOKEN = "s3cret-token-0123456789"
ENGINE = dict(dtype="float32", max_model_len=128, num_kv_blocks=64)


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return str(tiny_model("llama"))


def start(model_dir: str, **kwargs) -> BackgroundServer:
    options = ServerOptions(model=model_dir, host="127.0.0.1", port=0, **kwargs)
    return BackgroundServer(
        engine_factory(model=model_dir, progress=False, **ENGINE), options
    ).start()


@pytest.fixture(scope="module")
def tls_server(model_dir, certificate):
    cert, key = certificate
    server = start(model_dir, tls_cert=str(cert), tls_key=str(key), auth_token=TOKEN)
    yield server
    server.stop()


def test_bearer_token_guards_everything_but_health(tls_server, certificate):
    cert, _ = certificate
    with Client(tls_server.address, tls=str(cert), timeout=30) as anonymous:
        assert anonymous.health() == "SERVING"  # probes cannot send credentials
        for call in (
            lambda: collect(anonymous.generate([5, 6], max_tokens=2)),
            lambda: anonymous.tokenize("hi"),
            lambda: anonymous.abort("x"),
            lambda: anonymous.model_info(),
        ):
            with pytest.raises(ServerError) as info:
                call()
            assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
            assert "bearer token" in info.value.details
    with Client(tls_server.address, token="wrong", tls=str(cert), timeout=30) as wrong:
        with pytest.raises(ServerError) as info:
            wrong.tokenize("hi")
        assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
    with Client(tls_server.address, token=TOKEN, tls=str(cert), timeout=30) as client:
        assert collect(client.generate([5, 6], max_tokens=2)).finish_reason == "length"
        assert client.tokenize("hi")


def test_tls_server_refuses_plaintext_and_checks_the_name(tls_server, certificate):
    cert, _ = certificate
    with Client(tls_server.address, timeout=5) as plaintext, pytest.raises(ServerError) as info:
        plaintext.health()
    assert info.value.code == grpc.StatusCode.UNAVAILABLE
    port = tls_server.server.port
    # Through a name the certificate does not hold, verification fails.
    with Client(f"localhost:{port}", tls=str(cert), timeout=5) as wrong_name:
        with pytest.raises(ServerError) as info:
            wrong_name.health()
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
    with Client(f"localhost:{port}", tls=str(cert), server_name="kvloom.test", timeout=5) as named:
        assert named.health() == "SERVING"


def test_message_size_limit_and_reflection(model_dir):
    server = start(model_dir, max_message_bytes=4096)
    try:
        with Client(server.address, timeout=30) as client:
            with pytest.raises(ServerError) as info:
                client.tokenize("x" * 10000)
            assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert client.tokenize("x" * 100)
        channel = grpc.insecure_channel(server.address)
        services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
        channel.close()
        assert {"kvloom.v1.Generation", "grpc.health.v1.Health"} <= services
    finally:
        server.stop()


def test_bad_server_options_name_the_field(model_dir, tmp_path):
    cases = [
        (dict(tls_cert=str(tmp_path / "missing.pem")), "tls_cert"),
        (dict(port=70000), "port"),
        (dict(auth_token=" padded "), "auth_token"),
        (dict(max_message_bytes=10), "max_message_bytes"),
        (dict(keepalive_time_s=0), "keepalive_time_s"),
        (dict(max_waiting=-1), "max_waiting"),
    ]
    for kwargs, field in cases:
        with pytest.raises(ValueError, match=field):
            ServerOptions(model=model_dir, **kwargs)
    with pytest.raises(ValueError, match="tool_call_parser"):
        start(model_dir, tool_call_parser="no-such-parser")
