"""An asyncio face for the synchronous engine: one thread owns the Engine and steps it.

The Engine is not thread-safe, so exactly one thread (started here) touches it. The event
loop talks to that thread through an inbox of commands (add, abort, stats, stop); the thread
drains the inbox, steps while there is work, and hands each step's OutputDeltas back to
the loop in one `call_soon_threadsafe` call. With no work it blocks on the inbox, so an idle
server burns no CPU.

The engine's `step_deltas` runs the front door's one output processor (detokenization, stop
strings, which it aborts in the engine core at once): each stream gets per-step deltas,
never cumulative outputs to diff. An abort ends the stream here at once with the request's
final delta (held-back text flushed, invariant 8), whichever engine core runs it.

The interface is deliberately small (`start`, `add`, `abort`, `stats`, `shutdown`, `config`);
the engine underneath is an `OutputEngine` (cluster/engine.py) over the in-process core, a
scheduler actor's (`RemoteEngine`) or data-parallel replicas' (`ReplicaSet`).
An engine failure (a step that raised, an output that ended in error because a worker
died, a scheduler actor that died) ends every stream with `EngineFailed` and calls
`on_fatal`; the engine is then shut down and this object refuses new requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from kvloom.cluster.engine_channel import RequestError
from kvloom.cluster.frontend.errors import EngineDead, QueueFull, RequestIdInUse
from kvloom.cluster.frontend.request_metrics import RequestMetrics
from kvloom.cluster.outputs import OutputDelta
from kvloom.cluster.scheduler_actor import ReplicaFailed
from kvloom.contracts.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineLike(Protocol):
    config: Any

    def add_request(self, request_id: str, prompt: Any, params: SamplingParams) -> None: ...
    def abort_deltas(self, request_ids: list[str]) -> list[OutputDelta]: ...
    def step_deltas(self) -> list[OutputDelta | RequestError]: ...
    def has_unfinished_requests(self) -> bool: ...
    def stats(self) -> dict[str, Any]: ...
    def shutdown(self) -> None: ...


class RequestRejected(ValueError):
    """The engine refused a request (its message names the field)."""


class EngineFailed(RuntimeError):
    """The engine raised while stepping; every request in flight ends with this."""


class ReplicaUnavailable(EngineFailed):
    """The data-parallel replica serving this request failed; the other replicas still
    serve (UNAVAILABLE to the client, as EngineFailed, but the server keeps serving)."""


_STOP = ("stop",)


class RequestStream:
    """The OutputDeltas of one request: an async iterator that ends after the finished
    delta, or raises the request's error. When the consumer falls behind, a backlog of
    deltas is merged into one (nothing is lost) unless `coalesce` is off."""

    def __init__(self, request_id: str, coalesce: bool = True) -> None:
        self.request_id = request_id
        self.coalesce = coalesce
        self.admitted_at = time.monotonic()
        self._items: deque[OutputDelta | BaseException] = deque()
        self._ready = asyncio.Event()
        self._done = False

    def _push(self, item: OutputDelta | BaseException) -> None:
        self._items.append(item)
        self._ready.set()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> OutputDelta:
        if self._done:
            raise StopAsyncIteration
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        item = self._items.popleft()
        while (
            self.coalesce
            and isinstance(item, OutputDelta)
            and not item.finished
            and self._items
            and isinstance(self._items[0], OutputDelta)
        ):
            item = item.merged(self._items.popleft())
        if isinstance(item, BaseException):
            self._done = True
            raise item
        self._done = item.finished
        return item


class AsyncEngine:
    """Owns an engine (made by `engine_factory` inside the engine thread).

    `max_waiting` bounds the requests admitted beyond those that can run at once
    (`max_num_seqs`); past it, `add` raises QueueFull. `on_fatal` is called on the event
    loop if the engine fails while stepping (the server then reports NOT_SERVING).
    `coalesce` (on by default) merges the deltas a stream fell behind on into one; off,
    every step's delta is delivered (tests use this to replay exact splits).
    """

    def __init__(
        self,
        engine_factory: Callable[[], EngineLike],
        *,
        max_waiting: int = 1024,
        on_fatal: Callable[[BaseException], None] | None = None,
    ) -> None:
        if isinstance(max_waiting, bool) or not isinstance(max_waiting, int) or max_waiting < 0:
            raise ValueError(f"max_waiting must be an integer >= 0, got {max_waiting!r}")
        self._factory = engine_factory
        self._max_waiting = max_waiting
        self._on_fatal = on_fatal
        self.coalesce = True
        self._inbox: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._error: BaseException | None = None
        self._stopping = False
        self.config: Any = None
        self.max_in_flight = 0
        self.request_metrics = RequestMetrics()  # finished requests, for /metrics

    # ----- lifecycle (event loop side)

    async def start(self) -> None:
        """Builds the engine in its thread and starts stepping; raises what building raised."""
        if self._thread is not None:
            raise RuntimeError("AsyncEngine.start() called twice")
        self._loop = asyncio.get_running_loop()
        started: asyncio.Future = self._loop.create_future()
        self._thread = threading.Thread(
            target=self._run, args=(started,), name="kvloom-engine", daemon=True
        )
        self._thread.start()
        self.config = await started
        self.max_in_flight = self.config.scheduler.max_num_seqs + self._max_waiting

    @property
    def running(self) -> bool:
        return self.config is not None and self._error is None and not self._stopping

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def add(
        self,
        request_id: str,
        prompt: Any,
        params: SamplingParams,
        cache_salt: str | None = None,
    ) -> RequestStream:
        """Queues a request; returns its stream of OutputDeltas."""
        self._check_running()
        if request_id in self._streams:
            raise RequestIdInUse(f"request_id: {request_id!r} is already in use")
        if len(self._streams) >= self.max_in_flight:
            raise QueueFull(
                f"the server is at capacity ({len(self._streams)} requests in flight, "
                f"{self._max_waiting} may wait); retry later"
            )
        stream = RequestStream(request_id, coalesce=self.coalesce)
        self._streams[request_id] = stream
        self._inbox.put(("add", request_id, prompt, params, cache_salt))
        return stream

    def abort(self, request_ids: Sequence[str]) -> list[str]:
        """Aborts requests; unknown or finished ids are ignored. Returns the ids that were
        in flight. Their streams end with a finished delta whose finish_reason is "abort"."""
        live = [rid for rid in dict.fromkeys(request_ids) if rid in self._streams]
        if live and self._thread is not None and self._error is None:
            self._inbox.put(("abort", live))
        return live

    def abort_all(self) -> list[str]:
        """Aborts every request in flight (a drain that ran out of time)."""
        return self.abort(list(self._streams))

    async def stats(self) -> dict[str, Any]:
        """The engine's stats (taken between steps), plus the front door's counts."""
        self._check_running()
        assert self._loop is not None
        answer: asyncio.Future = self._loop.create_future()
        self._inbox.put(("stats", answer))
        stats = dict(await answer)
        stats["num_in_flight"] = len(self._streams)
        stats["max_in_flight"] = self.max_in_flight
        return stats

    async def shutdown(self) -> None:
        """Stops the thread: requests still in flight end with EngineDead; idempotent."""
        if self._thread is None or self._stopping:
            return
        self._stopping = True
        self._inbox.put(_STOP)
        await asyncio.to_thread(self._thread.join)

    def _check_running(self) -> None:
        if self._error is not None:
            raise EngineDead(f"the engine has failed: {self._error}")
        if self._stopping:
            raise EngineDead("the engine is shutting down")
        if self.config is None:
            raise EngineDead("the engine is not started")

    # ----- delivery (event loop side)

    def _deliver(self, batch: list[tuple[str, OutputDelta | BaseException]]) -> None:
        for request_id, item in batch:
            stream = self._streams.get(request_id)
            if stream is None:
                continue
            stream._push(item)
            if isinstance(item, BaseException) or item.finished:
                del self._streams[request_id]
            if isinstance(item, OutputDelta) and item.finished:
                self.request_metrics.observe(
                    item.metrics,
                    time.monotonic() - stream.admitted_at,
                    item.prompt_tokens,
                    item.completion_tokens,
                    item.finish_reason,
                )

    def _fatal(self, error: BaseException) -> None:
        self._error = error
        if self._on_fatal is not None:
            self._on_fatal(error)

    def _send(self, callback: Callable, *args: Any) -> None:
        assert self._loop is not None
        # A closed loop means nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(callback, *args)

    # ----- the engine thread

    def _run(self, started: asyncio.Future) -> None:
        try:
            engine = self._factory()
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting start()
            self._send(_set_exception, started, exc)
            return
        if hasattr(engine, "stream_only"):
            engine.stream_only()  # only deltas are read here: keep no logprob history
        self._send(_set_result, started, engine.config)
        # ids of the requests the engine holds
        live: set[str] = set()
        try:
            self._serve(engine, live)
        finally:
            reason = self._error or EngineDead("the engine has shut down")
            leftover = []
            while True:
                try:
                    leftover.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
            self._refuse(leftover)
            if live:
                self._send(self._deliver, [(rid, reason) for rid in live])
            try:
                engine.shutdown()
            except Exception:
                logger.exception("engine shutdown failed")

    def _serve(self, engine: EngineLike, live: set) -> None:
        while True:
            commands = [self._inbox.get()] if not engine.has_unfinished_requests() else []
            while True:
                try:
                    commands.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
            batch: list[tuple[str, OutputDelta | BaseException]] = []
            for i, command in enumerate(commands):
                if command is _STOP:
                    if batch:
                        self._send(self._deliver, batch)
                    self._refuse(commands[i + 1 :])
                    return
                self._apply(engine, command, live, batch)
            if engine.has_unfinished_requests():
                try:
                    outputs = engine.step_deltas()
                except ReplicaFailed as exc:
                    logger.error("%s; the engine is stopped", exc)
                    return self._fail(EngineFailed(str(exc)), live, batch)
                except Exception as exc:
                    logger.exception("engine step failed; the engine is stopped")
                    failure = EngineFailed(f"the engine failed while stepping: {exc!r}")
                    return self._fail(failure, live, batch)
                failed = getattr(engine, "failure", None) is not None
                failure = self._take_outputs(outputs, live, batch, failed)
                if failure is not None:
                    logger.error("%s; the engine is stopped", failure)
                    return self._fail(failure, live, batch)
            if batch:
                self._send(self._deliver, batch)

    @staticmethod
    def _take_outputs(
        outputs: list, live: set, batch: list, engine_failed: bool
    ) -> EngineFailed | None:
        """Queues a step's outputs for delivery. An output that ended in error while the
        engine reports a failure means it failed under every request (a worker died): that
        failure is returned. Without one, the error is that request's own (the KV cache
        cannot hold it): it is refused, and everyone else is served."""
        failure = None
        for out in outputs:
            if out.request_id not in live:
                continue
            if isinstance(out, RequestError):  # refused at admission (a remote engine)
                if out.replica_lost:
                    live.discard(out.request_id)
                    batch.append((out.request_id, ReplicaUnavailable(out.message)))
                    continue
                if out.engine_down:
                    failure = EngineFailed(f"the model replica failed: {out.message}")
                    continue  # stays live: it ends with the failure, like the rest
                live.discard(out.request_id)
                batch.append((out.request_id, RequestRejected(out.message)))
                continue
            if out.finish_reason == "error":
                if engine_failed:
                    failure = EngineFailed(f"the model replica failed: {out.stop_reason}")
                    continue  # stays live: it ends with the failure, like the rest
                live.discard(out.request_id)
                batch.append((out.request_id, RequestRejected(str(out.stop_reason))))
                continue
            if out.finished:
                live.discard(out.request_id)
            batch.append((out.request_id, out))
        return failure

    def _fail(self, failure: EngineFailed, live: set, batch: list) -> None:
        """Ends every live request with `failure`, then reports it (the engine is done)."""
        self._error = failure
        batch += [(rid, failure) for rid in live]
        live.clear()
        # One callback: readiness must drop before any stream's handler can run on the
        # error (two sends would let the loop serve the error between them).
        self._send(self._deliver_then_fatal, batch, failure)

    def _deliver_then_fatal(self, batch: list, failure: EngineFailed) -> None:
        self._deliver(batch)
        self._fatal(failure)

    def _refuse(self, commands: list[tuple]) -> None:
        """Answers commands that arrive after the engine stopped: nobody may wait forever."""
        reason = self._error or EngineDead("the engine has stopped")
        for command in commands:
            if command[0] == "stats":
                self._send(_set_exception, command[1], EngineDead(str(reason)))
            elif command[0] == "add":
                self._send(self._deliver, [(command[1], reason)])

    def _apply(self, engine: EngineLike, command: tuple, live: set, batch: list) -> None:
        kind = command[0]
        if kind == "add":
            _, request_id, prompt, params, cache_salt = command
            try:
                if cache_salt:
                    prompt = {**_as_prompt_dict(prompt), "cache_salt": cache_salt}
                engine.add_request(request_id, prompt, params)
            except ValueError as exc:
                batch.append((request_id, RequestRejected(str(exc))))
                return
            except Exception as exc:
                logger.exception("engine.add_request(%r) failed", request_id)
                batch.append((request_id, exc))
                return
            live.add(request_id)
        elif kind == "abort":
            ids = [rid for rid in command[1] if rid in live]  # else finished meanwhile
            for final in engine.abort_deltas(ids):
                live.discard(final.request_id)
                batch.append((final.request_id, final))
        elif kind == "stats":
            self._send(_set_result, command[1], engine.stats())
        else:
            raise AssertionError(f"unknown engine command {kind!r}")


def _as_prompt_dict(prompt: Any) -> dict[str, Any]:
    if isinstance(prompt, dict):
        return dict(prompt)
    if isinstance(prompt, str):
        return {"prompt": prompt}
    return {"prompt_token_ids": list(prompt)}


def _set_result(future: asyncio.Future, value: Any) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
