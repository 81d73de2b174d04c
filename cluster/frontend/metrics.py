"""Prometheus metrics over plain HTTP (`GET /metrics`), served on the event loop.

A dozen gauges and counters from the engine's stats need no client library: the text
exposition format is a line per sample.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from kvloom.cluster.frontend.ports import check_port_free

logger = logging.getLogger(__name__)

# stats key -> (metric name, type, help)
_METRICS = {
    "num_running": ("kvloom_requests_running", "gauge", "Requests being generated."),
    "num_waiting": ("kvloom_requests_waiting", "gauge", "Requests waiting to be scheduled."),
    "num_in_flight": ("kvloom_requests_in_flight", "gauge", "Requests admitted by the server."),
    "kv_cache_usage": ("kvloom_kv_cache_usage_ratio", "gauge", "Fraction of KV blocks in use."),
    "num_blocks": ("kvloom_kv_blocks", "gauge", "KV cache blocks in the pool."),
    "num_free_blocks": ("kvloom_kv_blocks_free", "gauge", "KV cache blocks free or evictable."),
    "num_finished": ("kvloom_requests_finished_total", "counter", "Requests finished."),
    "num_aborted": ("kvloom_requests_aborted_total", "counter", "Requests aborted."),
    "num_preemptions": ("kvloom_preemptions_total", "counter", "Requests preempted."),
    "num_steps": ("kvloom_engine_steps_total", "counter", "Engine steps run."),
    "prefix_cache_queried_tokens": (
        "kvloom_prefix_cache_queried_tokens_total",
        "counter",
        "Prompt tokens looked up in the prefix cache.",
    ),
    "prefix_cache_hit_tokens": (
        "kvloom_prefix_cache_hit_tokens_total",
        "counter",
        "Prompt tokens served from the prefix cache.",
    ),
    "num_evictions": ("kvloom_kv_block_evictions_total", "counter", "Cached blocks evicted."),
}


def render_metrics(stats: dict[str, Any], ready: bool) -> str:
    lines = [
        "# HELP kvloom_ready 1 when the server accepts requests.",
        "# TYPE kvloom_ready gauge",
        f"kvloom_ready {int(ready)}",
    ]
    for key, (name, kind, text) in _METRICS.items():
        value = stats.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}", f"{name} {value}"]
    return "\n".join(lines) + "\n"


class MetricsServer:
    def __init__(self, collect: Callable[[], Awaitable[str]]) -> None:
        self._collect = collect
        self._server: asyncio.base_events.Server | None = None

    async def start(self, host: str, port: int) -> int:
        """Listens on host:port (0: a free port); a port in use raises (never shared)."""
        check_port_free(host, port, "metrics port")
        try:
            self._server = await asyncio.start_server(self._handle, host, port, reuse_port=False)
        except OSError as exc:
            check_port_free(host, port, "metrics port")  # taken meanwhile: say so
            raise OSError(f"cannot listen on {host}:{port} for metrics: {exc.strerror}") from None
        return self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request_line = await asyncio.wait_for(reader.readline(), timeout=5)
            while (await asyncio.wait_for(reader.readline(), timeout=5)) not in (
                b"\r\n",
                b"\n",
                b"",
            ):
                pass  # headers: not needed
            parts = request_line.decode("latin-1").split()
            if len(parts) >= 2 and parts[0] == "GET" and parts[1].split("?")[0] == "/metrics":
                status, body = "200 OK", await self._collect()
            else:
                status, body = "404 Not Found", "only GET /metrics is served here\n"
            payload = body.encode()
            writer.write(
                f"HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4\r\n"
                f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode()
                + payload
            )
            await writer.drain()
        except (TimeoutError, ConnectionError):
            pass
        except Exception:
            logger.exception("metrics request failed")
        finally:
            writer.close()
