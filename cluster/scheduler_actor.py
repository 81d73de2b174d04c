"""The scheduler as a Ray actor, and the engine-core proxy the front door drives.

`SchedulerActor` owns the EngineCore: scheduler, KV-cache coordinator and (through the Ray
executor it creates) the worker actors. Its `serve` call is the engine loop, the same one
the in-process engine runs: take every command that arrived, step, send the step's
engine-core outputs (new token ids, no text). Commands and outputs travel over the zmq
channels of `engine_channel` (set up once through Ray), so a burst of requests costs one
message per loop turn, not one blocking Ray call each, and each step's tokens leave as soon
as the step ends.

`RemoteEngineCore` has the EngineCore's interface (`add_request`, `abort_requests`, `step`,
`has_unfinished_requests`, `stats`, `shutdown`); `RemoteEngine` puts the front door's
output processor in front of it (cluster/engine.py `OutputEngine`), so it is driven as the
in-process Engine is. Adds and aborts do not wait: an add the engine refuses comes back
from `step` as a `RequestError`; an abort ends the request's stream here at once. A dead
scheduler actor raises `ReplicaFailed` from `step` within a poll interval of Ray noticing
it.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from typing import Any

from kvloom.cluster.engine import OutputEngine
from kvloom.cluster.engine_channel import (
    AbortRequests,
    AddRequest,
    AskStats,
    Commands,
    Events,
    Rejection,
    RequestError,
)
from kvloom.cluster.outputs import EngineCoreOutput
from kvloom.cluster.prompt_checks import check_prompt_token_ids
from kvloom.contracts.sampling_params import SamplingParams
from kvloom.contracts.step_channel import ResultChannel, ResultSender

logger = logging.getLogger(__name__)

POLL_S = 0.02  # RemoteEngine.step: longest wait for events before checking the actor
IDLE_WAIT_S = 0.5  # the actor's loop with nothing to run: longest wait for a command
STATS_TIMEOUT_S = 60.0
SHUTDOWN_TIMEOUT_S = 30.0


class ReplicaFailed(RuntimeError):
    """The scheduler actor of this replica died or stopped; the message is for clients."""


def _node_host() -> str:
    """This process's address as Ray knows it (127.0.0.1 for an embedded local Ray)."""
    import ray

    return ray.util.get_node_ip_address()


class SchedulerActor:
    """Built empty; `start` builds the engine, so a failure there reaches the caller as
    its own exception (a failing actor constructor would be wrapped in Ray's texts)."""

    def __init__(self) -> None:
        self.engine = None
        self._commands: ResultChannel | None = None
        self._stop = threading.Event()
        self._served = threading.Event()

    # -- control calls (Ray) -----------------------------------------------------------
    def start(self, engine_kwargs: dict[str, Any]):
        """Builds the engine; returns (config, command address, placement or None, the
        prefix cache's hash block size)."""
        from kvloom.cluster.engine_core import EngineCore
        from kvloom.contracts.gc_freeze import freeze_startup_objects

        self.engine = EngineCore(**engine_kwargs)
        freeze_startup_objects()  # the actor's process serves this one engine
        self._commands = ResultChannel(msg_type=Commands, host=_node_host())
        placement = getattr(self.engine.executor, "placement", None)
        hash_block_size = self.engine.kv_cache.hash_block_size
        return self.engine.config, self._commands.address, placement, hash_block_size

    def serve(self, events_address: str) -> None:
        """The engine loop; returns after `shutdown`. The only thread touching the engine."""
        sender = ResultSender(events_address)
        failure_sent = False
        try:
            while not self._stop.is_set():
                engine = self.engine
                events = Events()
                wait = 0.0 if engine.has_unfinished_requests() else IDLE_WAIT_S
                for command in self._take_commands(wait):
                    self._apply(command, events)
                if engine.has_unfinished_requests():
                    for out in engine.step():
                        if isinstance(out, RequestError):  # refused after admission
                            events.rejections.append(Rejection(out.request_id, out.message))
                        else:
                            events.outputs.append(out)
                if engine.failure is not None and not failure_sent:
                    events.failure = engine.failure
                    failure_sent = True
                if events.outputs or events.rejections or events.stats or events.failure:
                    sender.send(events)
        finally:
            sender.close()
            self._served.set()

    def shutdown(self) -> None:
        self._stop.set()
        self._served.wait(timeout=SHUTDOWN_TIMEOUT_S)
        if self._commands is not None:
            self._commands.close()
        if self.engine is not None:
            self.engine.shutdown()

    # -- the loop's parts --------------------------------------------------------------
    def _take_commands(self, wait: float) -> list:
        commands = []
        try:
            commands += self._commands.recv(timeout=wait).items
            while True:
                commands += self._commands.recv(timeout=0).items
        except TimeoutError:
            pass
        return commands

    def _apply(self, command, events: Events) -> None:
        engine = self.engine
        if isinstance(command, AddRequest):
            arrival = time.monotonic() - command.age_s
            try:
                engine.add_request(
                    command.request_id,
                    command.prompt_token_ids,
                    command.params,
                    cache_salt=command.cache_salt,
                    arrival_time=arrival,
                )
            except ValueError as err:
                events.rejections.append(Rejection(command.request_id, str(err)))
            except RuntimeError as err:  # the engine is down (a worker died)
                events.rejections.append(Rejection(command.request_id, str(err), True))
        elif isinstance(command, AbortRequests):  # nothing to send: the front door ended them
            engine.abort_requests(command.request_ids, stopped=command.stopped)
        elif isinstance(command, AskStats):
            events.stats[command.ask_id] = engine.stats()


class RemoteEngineCore:
    """EngineCore-like proxy of a SchedulerActor. Use it from one thread (its zmq sockets
    are not thread-safe)."""

    def __init__(self, engine_kwargs: dict[str, Any]):
        import ray

        from kvloom.cluster.ray_local import actor_runtime_env, connect_ray

        connect_ray(num_cpus_for_local=16)
        # The actor needs four threads: serve (the loop), start, shutdown, and one spare.
        actor_class = ray.remote(num_cpus=0, max_concurrency=4)(SchedulerActor)
        self.actor = actor_class.options(runtime_env=actor_runtime_env()).remote()
        self._placement = None
        self._events: ResultChannel | None = None
        self._commands: ResultSender | None = None
        try:
            self.config, command_address, self._placement, self.hash_block_size = self._get(
                self.actor.start.remote(engine_kwargs)
            )
            self._events = ResultChannel(msg_type=Events, host=_node_host())
            self._commands = ResultSender(command_address)
            self._serve_ref = self.actor.serve.remote(self._events.address)
        except BaseException:
            self._release()
            raise
        self.vocab_size = int(self.config.model.text_config["vocab_size"])
        self._pending: list = []
        self._live: set[str] = set()
        self._ready: list[EngineCoreOutput | RequestError] = []
        self._stats: dict[int, dict[str, Any]] = {}
        self._ask_ids = itertools.count()
        self._counter = itertools.count()
        self.failure: str | None = None

    @staticmethod
    def _get(ref, timeout: float | None = None):
        """ray.get that raises the actor's own exception for a failed call (not Ray's
        wrapping of it)."""
        import ray

        try:
            return ray.get(ref, timeout=timeout)
        except ray.exceptions.RayTaskError as err:
            if isinstance(err.cause, Exception):
                raise err.cause from None
            raise

    # -- the Engine interface ------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        prompt: str | None = None,
    ) -> None:
        """Queues the request for the next `step` (raises ValueError for a bad one that can
        be told here; the engine's own refusals come back from `step`)."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        request_id = str(request_id)
        if request_id in self._live:
            raise ValueError(f"request_id {request_id!r} is already in use")
        max_len = int(self.config.scheduler.max_model_len)
        ids = check_prompt_token_ids(list(prompt_token_ids), self.vocab_size, max_len)
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError(f"cache_salt must be a string, got {cache_salt!r}")
        now = time.monotonic()
        age = 0.0 if arrival_time is None else max(0.0, now - arrival_time)
        self._pending.append(AddRequest(request_id, ids, params, cache_salt, age))
        self._live.add(request_id)

    def abort_requests(self, request_ids: list[str], stopped: bool = False) -> list[str]:
        """Ends the requests here at once (outputs still in flight for them are dropped)
        and in the engine with the next message. Returns the ids that were live."""
        ids = [rid for rid in dict.fromkeys(request_ids) if rid in self._live]
        if ids:
            self._live.difference_update(ids)
            self._pending.append(AbortRequests(ids, stopped))
            self._flush()  # now: nothing else may come to send it, and the blocks wait
        return ids

    def step(self, wait: float = POLL_S) -> list[EngineCoreOutput | RequestError]:
        """Sends what was queued, then returns the outputs (and refusals) that arrived,
        waiting up to `wait` for the first. Raises ReplicaFailed if the actor is gone
        (checked after a wait that saw nothing; with no wait, call `check_alive`)."""
        self._flush()
        results, self._ready = self._ready, []
        if not self._read_events(results, 0.0 if results else wait) and wait > 0:
            self.check_alive()
        return results

    @property
    def events_socket(self):
        """The socket outputs arrive on (ReplicaSet polls several replicas' at once)."""
        return self._events.socket

    def has_unfinished_requests(self) -> bool:
        return bool(self._live or self._ready or self._pending)

    def next_request_id(self) -> str:
        return str(next(self._counter))

    def stats(self) -> dict[str, Any]:
        """The engine's stats, taken in order with the commands sent before."""
        ask_id = next(self._ask_ids)
        self._pending.append(AskStats(ask_id))
        self._flush()
        deadline = time.monotonic() + STATS_TIMEOUT_S
        while ask_id not in self._stats:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the scheduler did not answer stats in {STATS_TIMEOUT_S} s")
            if not self._read_events(self._ready, POLL_S):
                self.check_alive()
        return self._stats.pop(ask_id)

    def shutdown(self) -> None:
        try:
            if self.check_alive(raise_error=False):
                self._get(self.actor.shutdown.remote(), timeout=SHUTDOWN_TIMEOUT_S)
        except Exception as err:  # the actor is going away regardless
            logger.warning("scheduler actor shutdown: %s", err)
        finally:
            self._release()

    # -- internals ---------------------------------------------------------------------
    def _flush(self) -> None:
        if self._pending:
            self._commands.send(Commands(self._pending))
            self._pending = []

    def _read_events(self, results: list, wait: float) -> bool:
        """Reads every Events message that arrived (waiting up to `wait` for the first)
        into `results`; returns whether any did."""
        got = False
        try:
            self._take(self._events.recv(timeout=wait), results)
            got = True
            while True:
                self._take(self._events.recv(timeout=0), results)
        except TimeoutError:
            pass
        return got

    def _take(self, events: Events, results: list) -> None:
        for out in events.outputs:
            if out.request_id not in self._live:
                continue  # aborted here meanwhile, or from an earlier engine
            if out.finished:
                self._live.discard(out.request_id)
            results.append(out)
        for rejection in events.rejections:
            if rejection.request_id in self._live:
                self._live.discard(rejection.request_id)
                results.append(
                    RequestError(rejection.request_id, rejection.message, rejection.engine_down)
                )
        self._stats.update(events.stats)
        if events.failure is not None:
            self.failure = events.failure

    def check_alive(self, raise_error: bool = True) -> bool:
        """Whether the actor's loop still runs; raises ReplicaFailed (if asked) when not."""
        import ray

        done, _ = ray.wait([self._serve_ref], timeout=0)
        if not done:
            return True
        try:
            ray.get(done[0])
            reason = "the scheduler of this replica stopped"
        except ray.exceptions.RayTaskError as err:
            logger.error("the scheduler loop raised: %s", err)
            reason = f"the scheduler of this replica failed: {type(err.cause).__name__}"
        except ray.exceptions.RayError as err:
            logger.error("the scheduler actor died: %s", err)
            reason = "the scheduler of this replica died"
        if raise_error:
            raise ReplicaFailed(reason)
        return False

    def _release(self) -> None:
        """Kills the actor and frees what it held (its workers die with it; its placement
        group outlives it unless removed here)."""
        import ray

        for channel in (self._commands, self._events):
            if channel is not None:
                channel.close()
        try:
            ray.kill(self.actor)
        except Exception as err:
            logger.debug("ray.kill of the scheduler actor: %s", err)
        if self._placement is not None:
            self._placement.remove()


class RemoteEngine(OutputEngine):
    """The Engine interface over a scheduler actor: this process's output processor in
    front of a `RemoteEngineCore` (its attributes, e.g. `actor`, read through)."""

    def __init__(self, engine_kwargs: dict[str, Any]):
        core = RemoteEngineCore(engine_kwargs)
        try:
            super().__init__(core)
        except BaseException:  # e.g. no tokenizer here: free the actor and its workers
            core.shutdown()
            raise
