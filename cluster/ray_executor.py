"""The Ray executor: worker actors in placement groups, steps over a zmq channel.

Ray places the actors (one bundle per device; each TP group packed on one node,
cluster/placement.py),
supervises them and carries control calls (setup, KV sizing, health). Each step is
published once on the step channel and the driver worker's result comes back on the result
channel (ARCHITECTURE §2: a Ray call round trip costs more than a small decode step).

Async scheduling: `submit` publishes a step and returns at once; the handle's `result()`
reads that step's output back. The workers pipeline (workers/ray_worker.py `run_loop`): a
step is read back once the step after it was launched behind it, or once a flush marker
arrives, which `result()` publishes when nothing went out after the step it waits for.
So the engine can publish step N+1 before it reads N, and results come back in order.

A worker that dies ends every in-flight step with `WorkerFailure` within seconds (its
`run_loop` call fails, which `result()` watches while it waits); the engine then fails
its requests and refuses new ones — it never hangs.
"""

from __future__ import annotations

import logging
import time

from kvloom.cluster.placement import place_grid
from kvloom.cluster.ray_local import actor_runtime_env, connect_ray, first_line
from kvloom.cluster.spec_decode.drafter_actor import (
    check_remote_placement,
    drafter_answers,
    start_drafter_actor,
)
from kvloom.contracts.config import EngineConfig
from kvloom.contracts.kv_cache_plan import KVCacheMemory, KVCachePlan, KVCacheSpecs
from kvloom.contracts.runner_output import ModelRunnerOutput
from kvloom.contracts.scheduler_output import GrammarBitmasks, SchedulerOutput
from kvloom.contracts.step_channel import ResultChannel, StepPublisher

logger = logging.getLogger(__name__)

POLL_S = 0.2


class WorkerFailure(RuntimeError):
    """A worker actor died or raised; the message says which and why."""


class RayExecutor:
    def __init__(self, config: EngineConfig, progress: bool = True):
        import ray

        from kvloom.workers.ray_worker import WorkerActor

        self.config = config
        self.drafter = None  # speculative_config.placement "remote": the drafter actor
        remote_drafter = config.speculative.enabled and config.speculative.placement == "remote"
        if remote_drafter:
            check_remote_placement(config)
        world = config.parallel.world_size
        # CPU slots of an embedded Ray are logical: enough for any grid we start here.
        connect_ray(num_cpus_for_local=max(16, world + 1))
        gpus = ray.cluster_resources().get("GPU", 0)
        self.use_gpu = config.device == "cuda" or (config.device == "auto" and gpus >= world)
        bundle = {"GPU": 1, "CPU": 1} if self.use_gpu else {"CPU": 1}
        parallel = config.parallel
        self.placement = place_grid(
            parallel.tensor_parallel_size, parallel.decode_context_parallel_size, bundle
        )
        actor_class = ray.remote(max_concurrency=2)(WorkerActor)
        self.actors = [
            actor_class.options(
                num_cpus=1,
                num_gpus=1 if self.use_gpu else 0,
                scheduling_strategy=self.placement.strategy(rank),
                runtime_env=actor_runtime_env(),
            ).remote(config, rank, self.use_gpu, progress and rank == 0)
            for rank in range(world)
        ]
        self.publisher = self.results = None
        self.loop_refs: list = []
        try:
            init_address = ray.get(self.actors[0].node_address.remote())
            self._call_all("setup", init_address)
            if remote_drafter:
                self.drafter = start_drafter_actor(config, self.use_gpu)
                self._call_all("attach_drafter", self.drafter)
        except Exception:
            self.shutdown()
            raise
        host = ray.util.get_node_ip_address()
        self.publisher = StepPublisher(world, host=host)
        self.results = ResultChannel(msg_type=ModelRunnerOutput, host=host)
        self.failure: str | None = None
        # Steps published and results read back, each counted from 0; results read ahead
        # of the handle that claims them; whether anything went out after the newest step.
        self._num_submitted = 0
        self._num_received = 0
        self._unclaimed: dict[int, ModelRunnerOutput] = {}
        self._newest_followed = True

    @property
    def device_type(self) -> str:
        return "cuda" if self.use_gpu else "cpu"

    def _call_all(self, method: str, *args):
        import ray

        try:
            return ray.get([getattr(a, method).remote(*args) for a in self.actors])
        except ray.exceptions.RayTaskError as err:
            if isinstance(err.cause, ValueError):  # bad configuration: say it as such
                raise ValueError(str(err.cause)) from None
            raise WorkerFailure(f"worker call {method} failed: {first_line(err)}") from err
        except ray.exceptions.RayError as err:
            raise WorkerFailure(f"worker call {method} failed: {first_line(err)}") from err

    def kv_cache_specs(self) -> KVCacheSpecs:
        """The ranks' layer specs. Every rank of the grid holds the same shard shapes, so
        they must agree; the plan made from them serves all."""
        specs = self._call_all("kv_cache_specs")
        differ = [rank for rank, s in enumerate(specs) if s != specs[0]]
        if differ:
            raise RuntimeError(f"worker ranks {differ} report other KV-cache specs than rank 0")
        return specs[0]

    def available_kv_memory(self, plan: KVCachePlan) -> KVCacheMemory:
        """The smallest memory any rank can give the cache (every rank holds every block)."""
        return min(self._call_all("available_kv_memory", plan), key=lambda m: m.available_bytes)

    def initialize_kv_cache(self, plan: KVCachePlan, num_blocks: int) -> None:
        self._call_all("initialize_kv_cache", plan, num_blocks)
        self.loop_refs = [
            a.run_loop.remote(self.publisher.address, self.results.address) for a in self.actors
        ]

    def drafter_available(self) -> bool | None:
        """Whether the remote drafter actor answers now (None: no remote drafter)."""
        return None if self.drafter is None else drafter_answers(self.drafter)

    def _check_workers(self) -> None:
        """Raises WorkerFailure if any step loop ended. The first rank to fail is often a
        survivor whose collective lost its peer, so wait a moment and name dead ranks first."""
        import ray

        done, _ = ray.wait(self.loop_refs, timeout=0)
        if not done:
            return
        done, _ = ray.wait(self.loop_refs, num_returns=len(self.loop_refs), timeout=1.0)
        died, failed = [], []
        for ref in done:
            rank = self.loop_refs.index(ref)
            # Clients read this (invariant 11): say what happened, not Ray's wording of it.
            try:
                ray.get(ref)
                failed.append(f"rank {rank}: its step loop ended")
            except ray.exceptions.ActorDiedError as err:
                logger.error("worker rank %d died: %s", rank, err)
                died.append(f"rank {rank} died (its process exited)")
            except ray.exceptions.RayTaskError as err:
                logger.error("worker rank %d failed: %s", rank, err)
                cause = err.cause if isinstance(err.cause, BaseException) else err
                failed.append(f"rank {rank} raised {type(cause).__name__}: {first_line(cause)}")
            except ray.exceptions.RayError as err:
                logger.error("worker rank %d is lost: %s", rank, err)
                failed.append(f"rank {rank} is lost ({type(err).__name__})")
        self.failure = "worker " + "; ".join(died + failed)
        raise WorkerFailure(self.failure)

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.submit(sched).result()

    def submit(self, sched: SchedulerOutput) -> RayPendingStep:
        """Publishes the step to every worker and returns at once; the handle's `result()`
        waits for its output. Steps run in the order they are submitted."""
        if self.failure:
            raise WorkerFailure(self.failure)
        self.publisher.publish(sched)
        index = self._num_submitted
        self._num_submitted += 1
        self._newest_followed = False
        return RayPendingStep(self, index)

    def send_bitmasks(self, masks: GrammarBitmasks) -> None:
        """The grammar masks of the step submitted last, on the step channel as a side
        message: it is no step, so the workers still keep that step open behind it."""
        if self.failure:
            raise WorkerFailure(self.failure)
        self.publisher.publish_side(masks)

    def _result(self, index: int) -> ModelRunnerOutput:
        """Step `index`'s output. Results arrive in step order; any read before the one
        asked for wait in `_unclaimed` for their own handle."""
        if self.failure:
            raise WorkerFailure(self.failure)
        if index in self._unclaimed:
            return self._unclaimed.pop(index)
        if index < self._num_received:
            raise RuntimeError(f"the result of step {index} was already read")
        if index == self._num_submitted - 1 and not self._newest_followed:
            # The workers keep the newest step open for the next one to queue behind it;
            # none is coming before this read, so tell them to send it now.
            self.publisher.publish_flush()
            self._newest_followed = True
        while True:
            try:
                out = self.results.recv(timeout=POLL_S)
            except TimeoutError:
                self._check_workers()
                continue
            received = self._num_received
            self._num_received += 1
            if received == index:
                return out
            self._unclaimed[received] = out

    def shutdown(self) -> None:
        import ray

        try:
            if self.publisher is not None:
                self.publisher.close()
            deadline = time.monotonic() + 10
            if self.loop_refs:
                ray.wait(
                    self.loop_refs,
                    num_returns=len(self.loop_refs),
                    timeout=max(0.0, deadline - time.monotonic()),
                )
            if self.results is not None:
                self.results.close()
        finally:
            for actor in self.actors:
                ray.kill(actor)
            if self.drafter is not None:
                ray.kill(self.drafter)
            self.placement.remove()


class RayPendingStep:
    """A step published to the workers; `result()` waits for its ModelRunnerOutput (and
    raises WorkerFailure within seconds if a worker dies meanwhile)."""

    def __init__(self, executor: RayExecutor, index: int):
        self.executor = executor
        self.index = index
        self._out: ModelRunnerOutput | None = None

    def result(self) -> ModelRunnerOutput:
        if self._out is None:
            self._out = self.executor._result(self.index)
        return self._out
