"""The chart's exec health probe (helm/kvloom/files/grpc_health_probe.py) against a real server.

A real gRPC server on 127.0.0.1 serves grpc.health.v1.Health (grpcio-health-checking), in
plaintext or TLS (a self-signed certificate made by the openssl CLI), optionally behind a
bearer-token interceptor. The probe runs as kubelet runs it: a separate process whose exit
status is the verdict. The last test runs the exact command line the chart renders.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from helm_render import CHART_DIR, container, manifests, one, render

SCRIPT = CHART_DIR / "files" / "grpc_health_probe.py"
GENERATION = "kvloom.v1.Generation"
SERVER_NAME = "kvloom.llm.svc"
TOKEN = "s3cret-token-0123456789"


class RequireToken(grpc.ServerInterceptor):
    """Rejects every call without `authorization: Bearer TOKEN`, health included."""

    def intercept_service(self, continuation, handler_call_details):
        if (("authorization", f"Bearer {TOKEN}")) in tuple(
            handler_call_details.invocation_metadata
        ):
            return continuation(handler_call_details)

        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

        return grpc.unary_unary_rpc_method_handler(deny)


def start_server(*, tls=None, require_token=False):
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=2),
        interceptors=[RequireToken()] if require_token else [],
    )
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    servicer.set(GENERATION, health_pb2.HealthCheckResponse.NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    if tls is None:
        port = server.add_insecure_port("127.0.0.1:0")
    else:
        credentials = grpc.ssl_server_credentials(
            [(tls["key"].read_bytes(), tls["cert"].read_bytes())]
        )
        port = server.add_secure_port("127.0.0.1:0", credentials)
    server.start()
    return server, servicer, port


@pytest.fixture
def plaintext_server():
    server, servicer, port = start_server()
    yield servicer, port
    server.stop(None)


@pytest.fixture(scope="module")
def certificate(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("the openssl CLI is needed to make a test certificate")
    directory = tmp_path_factory.mktemp("tls")
    cert, key = directory / "tls.crt", directory / "tls.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-days", "1", "-subj", f"/CN={SERVER_NAME}",
         "-addext", f"subjectAltName=DNS:{SERVER_NAME}",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    return {"cert": cert, "key": key, "dir": directory}


def probe(*args, timeout=1.0):
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--timeout", str(timeout), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_serving_service_passes(plaintext_server):
    _, port = plaintext_server
    result = probe("--addr", f"127.0.0.1:{port}", "--service", "")
    assert result.returncode == 0, result.stderr


def test_readiness_follows_the_generation_service(plaintext_server):
    servicer, port = plaintext_server
    result = probe("--addr", f"127.0.0.1:{port}", "--service", GENERATION)
    assert result.returncode == 1
    assert "NOT_SERVING" in result.stderr
    servicer.set(GENERATION, health_pb2.HealthCheckResponse.SERVING)
    assert probe("--addr", f"127.0.0.1:{port}", "--service", GENERATION).returncode == 0


def test_unknown_service_fails(plaintext_server):
    _, port = plaintext_server
    result = probe("--addr", f"127.0.0.1:{port}", "--service", "no.such.Service")
    assert result.returncode == 1
    assert "NOT_FOUND" in result.stderr


def test_no_server_fails_within_the_timeout():
    server, _, port = start_server()
    server.stop(None)  # the port is now closed
    result = probe("--addr", f"127.0.0.1:{port}", timeout=1.0)
    assert result.returncode == 1
    assert "UNAVAILABLE" in result.stderr or "DEADLINE_EXCEEDED" in result.stderr


def test_tls_server(certificate):
    server, _, port = start_server(tls=certificate)
    try:
        addr = ("--addr", f"127.0.0.1:{port}")
        trusted = ("--tls-ca", str(certificate["cert"]))
        assert probe(*addr, *trusted, "--tls-server-name", SERVER_NAME).returncode == 0
        wrong_name = probe(*addr, *trusted, "--tls-server-name", "other.llm.svc")
        assert wrong_name.returncode == 1
        # A plaintext check of a TLS server fails: why kubelet's native gRPC probe cannot be used.
        assert probe(*addr).returncode == 1
    finally:
        server.stop(None)


def test_bearer_token(tmp_path):
    server, _, port = start_server(require_token=True)
    try:
        token_file = tmp_path / "token"
        token_file.write_text(TOKEN + "\n")
        addr = ("--addr", f"127.0.0.1:{port}")
        assert probe(*addr, "--auth-token-file", str(token_file)).returncode == 0
        denied = probe(*addr)
        assert denied.returncode == 1
        assert "UNAUTHENTICATED" in denied.stderr
    finally:
        server.stop(None)


def test_the_command_line_the_chart_renders(certificate, tmp_path):
    """Run the readiness probe exactly as rendered, with its mounted paths mapped to files here."""
    values = {
        "tls": {"enabled": True, "cert": "x", "key": "y", "probe": {"serverName": SERVER_NAME}},
        "auth": {"enabled": True, "token": TOKEN},
    }
    cluster = one(manifests(render(values)), "RayCluster")
    serve = container(cluster["spec"]["headGroupSpec"]["template"]["spec"], "kvloom")
    command = serve["readinessProbe"]["exec"]["command"]
    (tmp_path / "token").write_text(TOKEN)
    server, servicer, port = start_server(tls=certificate, require_token=True)
    mapping = {
        "python": sys.executable,
        "/etc/kvloom/probe/grpc_health_probe.py": str(SCRIPT),
        "/etc/kvloom/tls/tls.crt": str(certificate["cert"]),
        "/etc/kvloom/auth/token": str(tmp_path / "token"),
        "127.0.0.1:50051": f"127.0.0.1:{port}",
    }
    local = [mapping.get(word, word) for word in command]
    assert not [word for word in local if word.startswith("/etc/kvloom/")], local
    try:
        not_ready = subprocess.run(local, capture_output=True, text=True, timeout=60)
        assert not_ready.returncode == 1, not_ready.stderr
        servicer.set(GENERATION, health_pb2.HealthCheckResponse.SERVING)
        ready = subprocess.run(local, capture_output=True, text=True, timeout=60)
        assert ready.returncode == 0, ready.stderr
    finally:
        server.stop(None)
