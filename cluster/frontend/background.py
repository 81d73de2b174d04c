"""A KvloomServer on its own event loop in a background thread, for code that is not
async itself: `kvloom quickstart`, tests, notebooks.

    with BackgroundServer(factory, ServerOptions(model=dir, host="127.0.0.1", port=0)) as s:
        client = kvloom.Client(s.address)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine
from typing import Any

from kvloom.cluster.frontend.options import ServerOptions
from kvloom.cluster.frontend.server import KvloomServer


class BackgroundServer:
    def __init__(self, engine_factory: Callable[[], Any], options: ServerOptions) -> None:
        self.server = KvloomServer(engine_factory, options)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None

    # ----- life cycle

    def start(self, timeout_s: float = 300.0) -> BackgroundServer:
        """Returns once the server is ready (warmed up), or raises why it is not."""
        self._thread = threading.Thread(target=self._main, name="kvloom-server", daemon=True)
        self._thread.start()
        if not self._started.wait(timeout_s):
            raise TimeoutError(f"the server was not ready within {timeout_s} s")
        if self._error is not None:
            self._thread.join()
            raise self._error
        return self

    def _main(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._serve())
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            loop.close()

    async def _serve(self) -> None:
        try:
            await self.server.start()
        except BaseException as exc:  # noqa: BLE001 - re-raised by start() in the caller
            self._error = exc
            self._started.set()
            return
        self._started.set()
        await self.server.wait_stopped()

    def stop(self, grace_s: float = 0.0) -> None:
        if self._thread is None or not self._thread.is_alive():
            return
        # A server that is stopping by itself (its engine failed, policy "exit") ends its
        # loop when done: nothing may be submitted to that loop any more, only waited for.
        if not self.server.stopping:
            self.call(self.server.stop(grace_s))
        self._thread.join()

    def drain(self, timeout_s: float | None = None) -> concurrent.futures.Future:
        """Starts a drain; the returned future completes when the server has stopped."""
        return self.submit(self.server.drain(timeout_s))

    def wait_stopped(self, timeout_s: float | None = None) -> None:
        assert self._thread is not None
        self._thread.join(timeout_s)

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc_info: Any) -> None:
        self.stop()

    # ----- talking to the server's loop

    @property
    def address(self) -> str:
        host = self.server.options.host
        if host in ("0.0.0.0", "::", "[::]", ""):
            host = "127.0.0.1"
        return f"{host}:{self.server.port}"

    def submit(self, coro: Coroutine) -> concurrent.futures.Future:
        assert self._loop is not None, "start() first"
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def call(self, coro: Coroutine, timeout_s: float | None = 60.0) -> Any:
        return self.submit(coro).result(timeout_s)

    def stats(self) -> dict[str, Any]:
        """The engine's stats, taken between two steps."""
        return self.call(self.server.engine.stats())
