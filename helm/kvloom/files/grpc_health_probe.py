"""Exec probe: call grpc.health.v1.Health/Check on the local kvloom server.

Kubelet's native gRPC probe speaks plaintext only and sends no metadata, so when the server
runs with TLS (or a bearer token guards every RPC) the chart runs this script instead. Exit
status 0 means the service reported SERVING; anything else (an RPC error, NOT_SERVING,
SERVICE_UNKNOWN) exits 1 with the reason on stderr, which kubelet records in the pod events.

Needs only grpcio and grpcio-health-checking, both dependencies of kvloom.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--addr", default="127.0.0.1:50051", help="host:port of the server")
    parser.add_argument("--service", default="", help='health service name ("" = server)')
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds for the RPC")
    parser.add_argument("--tls-ca", help="PEM file to trust; enables TLS")
    parser.add_argument("--tls-server-name", help="name expected in the server certificate")
    parser.add_argument("--auth-token-file", help="file holding a bearer token to send")
    return parser.parse_args(argv)


def open_channel(args: argparse.Namespace) -> grpc.Channel:
    if not args.tls_ca:
        return grpc.insecure_channel(args.addr)
    credentials = grpc.ssl_channel_credentials(root_certificates=Path(args.tls_ca).read_bytes())
    # The probe dials 127.0.0.1, which the certificate does not name; check the name it does.
    options = []
    if args.tls_server_name:
        options.append(("grpc.ssl_target_name_override", args.tls_server_name))
    return grpc.secure_channel(args.addr, credentials, options=options)


def check(args: argparse.Namespace) -> str | None:
    """Returns None when SERVING, else the reason the probe fails."""
    metadata = []
    if args.auth_token_file:
        token = Path(args.auth_token_file).read_text().strip()
        metadata.append(("authorization", f"Bearer {token}"))
    with open_channel(args) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(
                health_pb2.HealthCheckRequest(service=args.service),
                timeout=args.timeout,
                metadata=metadata,
            )
        except grpc.RpcError as error:
            return f"{error.code().name}: {error.details()}"
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        return f"service {args.service!r} is {status}"
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    reason = check(args)
    if reason is not None:
        print(f"health check of {args.addr} failed: {reason}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
