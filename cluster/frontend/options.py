"""The gRPC server's own settings (the engine's are the Engine's keyword arguments)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from kvloom.cluster.frontend.limits import FrontendLimits

AUTO = "auto"
NONE = "none"
ON_WORKER_FAILURE = ("restart", "exit")


def _positive(name: str, value: float) -> None:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not (ok and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a number > 0, got {value!r}")


@dataclass
class ServerOptions:
    model: str  # the model directory: the server reads its tokenizer and chat template
    host: str = "127.0.0.1"  # loopback unless told (a pod passes --host 0.0.0.0)
    port: int = 50051  # 0: pick a free port (see KvloomServer.port)
    tls_cert: str | None = None  # PEM files; both or neither
    tls_key: str | None = None
    auth_token: str | None = None  # clients must send `authorization: Bearer TOKEN`
    max_message_bytes: int = 64 * 1024 * 1024
    keepalive_time_s: float = 60.0  # the server pings idle connections this often
    keepalive_timeout_s: float = 20.0  # and drops them if a ping is not answered in time
    min_client_ping_interval_s: float = 10.0  # clients may ping no more often than this
    max_waiting: int = 1024  # requests admitted beyond max_num_seqs; more: RESOURCE_EXHAUSTED
    tool_call_parser: str = AUTO  # a parser name, "auto" (by model type) or "none"
    reasoning_parser: str = AUTO
    drain_timeout_s: float = 30.0  # SIGTERM: how long in-flight requests may finish
    metrics_port: int | None = None  # Prometheus text on http://host:PORT/metrics
    # The OpenAI-compatible HTTP API on host:PORT (None: off), with /health and /metrics;
    # TLS and the bearer token as for gRPC (docs/http.md).
    http_port: int | None = None
    served_model_name: str | None = None  # the model's id over HTTP; None: `model` as given
    warmup: bool = True  # one short generation before reporting SERVING
    # An engine that fails (a worker or the scheduler died): rebuild it and serve again
    # ("restart"), or stop the server so its process exits non-zero ("exit").
    on_worker_failure: str = "restart"
    # Render worker processes: tokenizing prompts, Detokenize, chat template rendering.
    tokenizer_threads: int = 2
    limits: FrontendLimits = field(default_factory=FrontendLimits)  # docs/grpc.md, "Limits"

    def __post_init__(self) -> None:
        if not Path(self.model).is_dir():
            raise ValueError(f"model must be an existing directory, got {self.model!r}")
        for name in ("port", "metrics_port", "http_port"):
            value = getattr(self, name)
            if value is None and name != "port":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 65535:
                raise ValueError(f"{name} must be an integer in [0, 65535], got {value!r}")
        if self.served_model_name is not None and (
            not self.served_model_name or not self.served_model_name.isprintable()
        ):
            raise ValueError(
                f"served_model_name must be non-empty printable text, got {self.served_model_name!r}"
            )
        if self.on_worker_failure not in ON_WORKER_FAILURE:
            raise ValueError(
                f"on_worker_failure must be one of {ON_WORKER_FAILURE}, got {self.on_worker_failure!r}"
            )
        if (self.tls_cert is None) != (self.tls_key is None):
            given, missing = (
                ("tls_cert", "tls_key") if self.tls_key is None else ("tls_key", "tls_cert")
            )
            raise ValueError(f"{given} needs {missing} too (both or neither)")
        for name in ("tls_cert", "tls_key"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"{name} must be an existing PEM file, got {path!r}")
        if self.auth_token is not None and (
            not self.auth_token or self.auth_token.strip() != self.auth_token
        ):
            raise ValueError("auth_token must be non-empty with no surrounding whitespace")
        if (
            isinstance(self.max_message_bytes, bool)
            or not isinstance(self.max_message_bytes, int)
            or self.max_message_bytes < 1024
        ):
            raise ValueError(
                f"max_message_bytes must be an integer >= 1024, got {self.max_message_bytes!r}"
            )
        for name in (
            "keepalive_time_s",
            "keepalive_timeout_s",
            "min_client_ping_interval_s",
            "drain_timeout_s",
        ):
            _positive(name, getattr(self, name))
        if isinstance(self.max_waiting, bool) or not isinstance(self.max_waiting, int):
            raise ValueError(f"max_waiting must be an integer >= 0, got {self.max_waiting!r}")
        if self.max_waiting < 0:
            raise ValueError(f"max_waiting must be an integer >= 0, got {self.max_waiting!r}")
        if not isinstance(self.tokenizer_threads, int) or self.tokenizer_threads < 1:
            raise ValueError(
                f"tokenizer_threads must be an integer >= 1, got {self.tokenizer_threads!r}"
            )

    def grpc_options(self) -> list[tuple[str, int]]:
        return [
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.keepalive_time_ms", int(self.keepalive_time_s * 1000)),
            ("grpc.keepalive_timeout_ms", int(self.keepalive_timeout_s * 1000)),
            ("grpc.keepalive_permit_without_calls", 1),
            (
                "grpc.http2.min_recv_ping_interval_without_data_ms",
                int(self.min_client_ping_interval_s * 1000),
            ),
            ("grpc.http2.max_ping_strikes", 0),  # never punish pings for being frequent
            # gRPC shares ports by default (SO_REUSEPORT): a second server on a port in use
            # would start and take half its connections. A port in use is an error.
            ("grpc.so_reuseport", 0),
        ]


def read_token_file(path: str) -> str:
    """A bearer token from a file (a mounted Kubernetes secret), surrounding space removed."""
    try:
        token = Path(path).read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise ValueError(f"auth_token_file: cannot read {path!r}: {exc.strerror}") from None
    if not token:
        raise ValueError(f"auth_token_file: {path!r} is empty")
    return token
