"""The gRPC front door: an asyncio engine wrapper (one thread owns the Engine), per-request
streaming state (deltas, stop-string hold-back, reasoning and tool-call parsing), request
validation, and the grpc.aio server with health, reflection, auth, metrics and draining.

Names are imported on first use, so the CLI can load `client_cli` without grpc's server."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "AsyncEngine": "async_engine",
    "RequestStream": "async_engine",
    "BackgroundServer": "background",
    "build_engine": "engine_builder",
    "engine_factory": "engine_builder",
    "ServerOptions": "options",
    "SERVICE_NAME": "server",
    "KvloomServer": "server",
    "serve_until_signal": "server",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(f"{__name__}.{_EXPORTS[name]}")
    return getattr(module, name)
