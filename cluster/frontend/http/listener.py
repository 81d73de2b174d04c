"""uvicorn on the server's own event loop, beside grpc.aio.

The socket is bound here (SO_REUSEADDR, never SO_REUSEPORT: a port in use is an error, said
in one line), and uvicorn keeps its hands off the process: no logging set-up, and no signal
handlers, since SIGTERM belongs to the kvloom server (it drains both doors).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket

import uvicorn

from kvloom.cluster.frontend.ports import check_port_free


class _Uvicorn(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        yield


def _bind(host: str, port: int, what: str) -> socket.socket:
    check_port_free(host, port, what)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto named: asyncio turns on TCP_NODELAY only for sockets whose proto is TCP, and
    # without it each response's second write waited out the client's delayed ACK (40 ms).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
        sock.setblocking(False)
    except OSError:
        sock.close()
        check_port_free(host, port, what)  # taken meanwhile: say so
        raise
    return sock


class HttpListener:
    def __init__(
        self,
        app,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        what: str = "HTTP port",  # how errors name the port
    ) -> None:
        self._what = what
        self._config = uvicorn.Config(
            app,
            http="h11",
            lifespan="off",
            log_config=None,  # kvloom's logging stays as it is
            log_level="warning",
            access_log=False,
            server_header=False,
            ssl_certfile=tls_cert,
            ssl_keyfile=tls_key,
        )
        self._server = _Uvicorn(self._config)
        self._task: asyncio.Task | None = None

    async def start(self, host: str, port: int) -> int:
        """Listens on host:port (0: a free port); returns the port."""
        sock = _bind(host, port, self._what)
        bound = sock.getsockname()[1]
        self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises why it could not start
                raise OSError(f"the HTTP server on {host}:{bound} stopped while starting")
            await asyncio.sleep(0.01)
        return bound

    async def stop(self, grace_s: float) -> None:
        """Stops listening; responses still running after `grace_s` are cancelled."""
        if self._task is None:
            return
        self._config.timeout_graceful_shutdown = max(grace_s, 0.01)
        self._server.should_exit = True
        await self._task
