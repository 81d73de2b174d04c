"""Data-parallel replicas behind one front door (`kvloom serve --data-parallel-size N`).

Each replica is a scheduler actor with its own TP × DCP worker grid, driven through its
`RemoteEngineCore`. `ReplicaSetCore` has the same engine-core interface: `add_request`
routes (cluster/routing.py), `step` sends every replica what was queued for it and gathers
the outputs that arrived from any of them, waiting on all their channels at once.
`ReplicaSet` puts the front door's one output processor in front of it (cluster/engine.py
`OutputEngine`), so the front door's AsyncEngine runs on it as on one engine.

A replica that fails (its scheduler actor died, or its engine lost a worker) leaves routing
at once; its requests end with `RequestError(replica_lost=True)` (UNAVAILABLE to clients),
while the other replicas keep serving. With `restart` on, it is rebuilt in the background
and rejoins routing when it is up; with it off, the failure is the whole engine's
(`ReplicaFailed`), as for one replica under `--on-worker-failure exit`.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import zmq

from kvloom.cluster.engine import OutputEngine
from kvloom.cluster.engine_channel import RequestError
from kvloom.cluster.outputs import EngineCoreOutput
from kvloom.cluster.routing import Router
from kvloom.cluster.scheduler_actor import POLL_S, RemoteEngineCore, ReplicaFailed
from kvloom.contracts.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

RESTART_ATTEMPTS = 3
RESTART_BACKOFF_S = 2.0


class ReplicaSetCore:
    """EngineCore-like front of N replicas; use it from one thread (as RemoteEngineCore)."""

    def __init__(
        self,
        engine_kwargs: dict[str, Any],
        num_replicas: int,
        routing: str = "prefix",
        restart: bool = True,
        start_replica: Callable[[dict[str, Any]], RemoteEngineCore] = RemoteEngineCore,
    ):
        self._kwargs = dict(engine_kwargs)
        self._start_replica = start_replica
        self.restart = restart
        self.replicas: list[RemoteEngineCore | None] = self._start_all(num_replicas)
        first = self.replicas[0]
        self.config = first.config
        self.vocab_size = first.vocab_size
        self.router = Router(num_replicas, routing, first.hash_block_size)
        self._where: dict[str, int] = {}  # request id -> replica serving it
        self._errors: list[RequestError] = []  # failures to hand back from the next step
        self._restarted: dict[int, RemoteEngineCore] = {}  # rebuilt, waiting to rejoin
        self._restarts: dict[int, threading.Thread] = {}
        self._lock = threading.Lock()
        self.num_replica_failures = 0
        self._closed = False
        self._counter = itertools.count()

    def _start_all(self, n: int) -> list[RemoteEngineCore | None]:
        """Starts the replicas side by side; if any fails, stops the others and raises."""
        with ThreadPoolExecutor(max_workers=n, thread_name_prefix="kvloom-replica") as pool:
            futures = [pool.submit(self._start_replica, dict(self._kwargs)) for _ in range(n)]
            replicas, errors = [], []
            for future in futures:
                try:
                    replicas.append(future.result())
                except BaseException as exc:  # noqa: BLE001 - re-raised below
                    errors.append(exc)
        if errors:
            for replica in replicas:
                replica.shutdown()
            raise errors[0]
        return replicas

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
        request_id = str(request_id)
        if request_id in self._where:
            raise ValueError(f"request_id {request_id!r} is already in use")
        self._rejoin_restarted()
        index = self.router.choose(list(prompt_token_ids), cache_salt)
        if index is None:
            self._errors.append(
                RequestError(request_id, "no model replica is up (restarting)", replica_lost=True)
            )
            return
        try:
            self.replicas[index].add_request(
                request_id, prompt_token_ids, params, cache_salt, arrival_time
            )
        except BaseException:
            self.router.finished(index)
            raise
        self._where[request_id] = index

    def abort_requests(self, request_ids: list[str], stopped: bool = False) -> list[str]:
        """Ends the requests here at once and in their replicas with the next message."""
        by_replica: dict[int, list[str]] = {}
        for rid in dict.fromkeys(request_ids):
            if rid in self._where:
                by_replica.setdefault(self._where.pop(rid), []).append(rid)
        for index, rids in by_replica.items():
            for _ in rids:
                self.router.finished(index)
            if self.replicas[index] is not None:
                self.replicas[index].abort_requests(rids, stopped)
        return [rid for rids in by_replica.values() for rid in rids]

    def step(self) -> list[EngineCoreOutput | RequestError]:
        """Outputs (and refusals, and failed replicas' requests) from every replica,
        waiting up to POLL_S on all their channels for the first."""
        self._rejoin_restarted()
        results: list[EngineCoreOutput | RequestError] = self._errors
        self._errors = []
        busy = self._busy()
        self._gather(busy, results)
        if not results and busy:
            self._wait_any(busy)
            self._gather(busy, results)
            if not results:
                for index in busy:
                    self._check(index)
                results, self._errors = self._errors, []
        return results

    def has_unfinished_requests(self) -> bool:
        return bool(self._where or self._errors)

    def next_request_id(self) -> str:
        return str(next(self._counter))

    def stats(self) -> dict[str, Any]:
        """Sums of the replicas' counters (means of their rates and usage), with each
        replica's own stats and routing figures under `replicas`."""
        per_replica = []
        for index, replica in enumerate(self.replicas):
            entry: dict[str, Any] = dict(self.router.describe()[index])
            if self.router.replicas[index].up and replica is not None:
                try:
                    entry.update(replica.stats())
                except (ReplicaFailed, TimeoutError) as err:
                    entry["error"] = str(err)
            per_replica.append(entry)
        total = _merge([e for e in per_replica if "num_blocks" in e])
        total["data_parallel_size"] = len(self.replicas)
        total["num_replicas_up"] = sum(r.up for r in self.router.replicas)
        total["num_replica_failures"] = self.num_replica_failures
        total["routing"] = self.router.policy
        total["replicas"] = per_replica
        return total

    def shutdown(self) -> None:
        self._closed = True
        for thread in list(self._restarts.values()):
            thread.join(timeout=60)
        with self._lock:
            late = list(self._restarted.values())
            self._restarted.clear()
        for replica in [*self.replicas, *late]:
            if replica is not None:
                replica.shutdown()

    # -- internals ---------------------------------------------------------------------
    def _busy(self) -> list[int]:
        return [
            i
            for i, r in enumerate(self.replicas)
            if r is not None and self.router.replicas[i].up and r.has_unfinished_requests()
        ]

    def _gather(self, busy: list[int], results: list) -> None:
        for index in busy:
            if not self.router.replicas[index].up:
                continue  # lost earlier in this step
            try:
                outputs = self.replicas[index].step(wait=0.0)
            except ReplicaFailed as err:
                self._lose(index, str(err))
                continue
            for out in outputs:
                self._take(index, out, results)
        results += self._errors
        self._errors = []

    def _take(self, index: int, out, results: list) -> None:
        if out.request_id not in self._where:
            return
        # An output ending in error is the replica's failure only when the replica says it
        # failed; else it is the request's own (the KV cache cannot hold it).
        lost = (isinstance(out, RequestError) and out.engine_down) or (
            isinstance(out, EngineCoreOutput)
            and out.finish_reason == "error"
            and self.replicas[index].failure is not None
        )
        if lost:
            reason = out.message if isinstance(out, RequestError) else out.stop_reason
            self._lose(index, str(reason))
            return
        if isinstance(out, RequestError) or out.finished:
            del self._where[out.request_id]
            self.router.finished(index)
        results.append(out)

    def _wait_any(self, busy: list[int]) -> None:
        poller = zmq.Poller()
        for index in busy:
            poller.register(self.replicas[index].events_socket, zmq.POLLIN)
        poller.poll(POLL_S * 1000)

    def _check(self, index: int) -> None:
        try:
            self.replicas[index].check_alive()
        except ReplicaFailed as err:
            self._lose(index, str(err))

    def _lose(self, index: int, reason: str) -> None:
        """Takes the replica out of routing and fails its requests; then restarts it or,
        without restarts, fails the whole engine."""
        if not self.router.replicas[index].up:
            return
        logger.error("model replica %d failed: %s", index, reason)
        self.num_replica_failures += 1
        self.router.set_up(index, False)
        message = f"model replica {index} failed ({reason})"
        for rid in [rid for rid, i in self._where.items() if i == index]:
            del self._where[rid]
            self._errors.append(RequestError(rid, message, replica_lost=True))
        if not self.restart:
            raise ReplicaFailed(message)
        old, self.replicas[index] = self.replicas[index], None
        thread = threading.Thread(
            target=self._rebuild, args=(index, old), name=f"kvloom-replica-{index}", daemon=True
        )
        self._restarts[index] = thread
        thread.start()

    def _rebuild(self, index: int, old: RemoteEngineCore | None) -> None:
        if old is not None:
            try:
                old.shutdown()
            except Exception:
                logger.exception("shutting down failed replica %d", index)
        for attempt in range(1, RESTART_ATTEMPTS + 1):
            if self._closed:
                return
            try:
                replica = self._start_replica(dict(self._kwargs))
            except Exception as err:
                logger.error("restarting replica %d (attempt %d) failed: %s", index, attempt, err)
                time.sleep(RESTART_BACKOFF_S * attempt)
                continue
            with self._lock:
                self._restarted[index] = replica
            logger.info("model replica %d is restarted", index)
            return
        logger.error("model replica %d stays down after %d restarts", index, RESTART_ATTEMPTS)

    def _rejoin_restarted(self) -> None:
        if not self._restarted:
            return
        with self._lock:
            ready, self._restarted = self._restarted, {}
        for index, replica in ready.items():
            self.replicas[index] = replica
            self._restarts.pop(index, None)
            self.router.set_up(index, True)
            logger.info("model replica %d rejoined routing", index)


def _merge(stats: list[dict[str, Any]]) -> dict[str, Any]:
    """One engine's view of several: counters add up, rates and usage average."""
    if not stats:
        return {}
    merged: dict[str, Any] = {}
    for key, value in stats[0].items():
        values = [s[key] for s in stats if key in s]
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        averaged = key.endswith(("_rate", "_usage", "_length")) or key == "block_size"
        merged[key] = sum(values) / len(values) if averaged else sum(values)
    return merged


class ReplicaSet(OutputEngine):
    """The Engine interface over N replicas: one output processor (this process's) in
    front of a `ReplicaSetCore` (its attributes, e.g. `router`, `replicas`, read through)."""

    def __init__(
        self,
        engine_kwargs: dict[str, Any],
        num_replicas: int,
        routing: str = "prefix",
        restart: bool = True,
        start_replica: Callable[[dict[str, Any]], RemoteEngineCore] = RemoteEngineCore,
    ):
        core = ReplicaSetCore(engine_kwargs, num_replicas, routing, restart, start_replica)
        try:
            super().__init__(core)
        except BaseException:  # e.g. no tokenizer here: free the replicas
            core.shutdown()
            raise
