"""The scheduler as a Ray actor, and the engine-like proxy the front door drives.

`SchedulerActor` owns the Engine: scheduler, KV-cache coordinator and (through the Ray
executor it creates) the worker actors. It steps in its own thread; requests come in and
outputs go out over async Ray calls: `poll` returns every output produced since the last
poll (blocking briefly while there is none), so one call carries many steps' outputs.

`RemoteEngine` has the synchronous Engine's interface (`add_request`, `abort_request`,
`step`, `has_unfinished_requests`, `stats`, `shutdown`), so the front door's AsyncEngine
runs unchanged on top of it.
"""

from __future__ import annotations

import itertools
import queue
import threading
from typing import Any

from kvloom.cluster.outputs import RequestOutput
from kvloom.cluster.sampling_params import SamplingParams

POLL_TIMEOUT_S = 0.05


class SchedulerActor:
    def __init__(self, engine_kwargs: dict[str, Any]):
        from kvloom.cluster.engine import Engine
        from kvloom.cluster.gc_freeze import freeze_startup_objects

        self.engine = Engine(**engine_kwargs)
        freeze_startup_objects()  # the actor's process serves this one engine
        self._inbox: queue.Queue = queue.Queue()
        self._outputs: list[RequestOutput] = []
        self._cond = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="kvloom-scheduler", daemon=True)
        self._thread.start()

    # -- called by the front door (Ray calls, from several threads) -----------------
    def config(self):
        return self.engine.config

    def add_request(self, request_id: str, prompt: Any, params: SamplingParams) -> None:
        """Raises the engine's ValueError (naming the field) for a bad request."""
        return self._call("add", request_id, prompt, params)

    def abort_request(self, request_ids: list[str]) -> list[RequestOutput]:
        return self._call("abort", request_ids)

    def stats(self) -> dict[str, Any]:
        return self._call("stats")

    def poll(self, timeout_s: float = POLL_TIMEOUT_S) -> list[RequestOutput]:
        with self._cond:
            if not self._outputs and not self._stopped:
                self._cond.wait(timeout_s)
            out, self._outputs = self._outputs, []
        return out

    def shutdown(self) -> None:
        self._call("stop")
        self._thread.join(timeout=30)

    # -- the scheduler thread (the only one touching the engine) ---------------------
    def _call(self, *command):
        done: queue.Queue = queue.Queue(maxsize=1)
        self._inbox.put((command, done))
        ok, value = done.get()
        if not ok:
            raise value
        return value

    def _apply(self, command: tuple):
        kind, *args = command
        if kind == "add":
            return self.engine.add_request(*args)
        if kind == "abort":
            return self.engine.abort_request(*args)
        if kind == "stats":
            return self.engine.stats()
        if kind == "stop":
            self._stopped = True
            return self.engine.shutdown()
        raise ValueError(f"unknown scheduler command {kind!r}")

    def _loop(self) -> None:
        while not self._stopped:
            block = not self.engine.has_unfinished_requests()
            try:
                command, done = self._inbox.get(block=block, timeout=1.0 if block else None)
            except queue.Empty:
                command = None
            while command is not None:
                try:
                    done.put((True, self._apply(command)))
                except Exception as err:  # handed back to the caller
                    done.put((False, err))
                try:
                    command, done = self._inbox.get_nowait()
                except queue.Empty:
                    command = None
            if not self._stopped and self.engine.has_unfinished_requests():
                outputs = self.engine.step()
                if outputs:
                    with self._cond:
                        self._outputs.extend(outputs)
                        self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()


class RemoteEngine:
    """Engine-like proxy of a SchedulerActor (what the front door's AsyncEngine drives)."""

    def __init__(self, engine_kwargs: dict[str, Any]):
        import ray

        from kvloom.cluster.ray_executor import connect_ray

        connect_ray(num_cpus_for_local=16)
        actor_class = ray.remote(num_cpus=0, max_concurrency=8)(SchedulerActor)
        self.actor = actor_class.remote(engine_kwargs)
        self.config = self._get(self.actor.config.remote())
        self._live: set[str] = set()
        self._counter = itertools.count()

    @staticmethod
    def _get(ref):
        import ray

        try:
            return ray.get(ref)
        except ray.exceptions.RayTaskError as err:
            cause = err.as_instanceof_cause()
            if isinstance(cause, ValueError):
                raise ValueError(str(err.cause)) from None
            raise

    def add_request(self, request_id: str, prompt: Any, params: SamplingParams) -> None:
        self._get(self.actor.add_request.remote(request_id, prompt, params))
        self._live.add(request_id)

    def abort_request(self, request_id: str | list[str]) -> list[RequestOutput]:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        finals = self._get(self.actor.abort_request.remote(ids))
        self._live.difference_update(ids)
        return finals

    def step(self) -> list[RequestOutput]:
        outputs = [o for o in self._get(self.actor.poll.remote()) if o.request_id in self._live]
        for out in outputs:
            if out.finished:
                self._live.discard(out.request_id)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self._live)

    def next_request_id(self) -> str:
        return str(next(self._counter))

    def stats(self) -> dict[str, Any]:
        return self._get(self.actor.stats.remote())

    def shutdown(self) -> None:
        import ray

        try:
            self._get(self.actor.shutdown.remote())
        finally:
            ray.kill(self.actor)
