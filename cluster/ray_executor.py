"""The Ray executor: worker actors in a placement group, steps over a zmq channel.

Ray places the actors (one bundle per device, packed on one node for tensor parallelism),
supervises them and carries control calls (setup, KV sizing, health). Each step is
published once on the step channel and the driver worker's result comes back on the result
channel (ARCHITECTURE §2: a Ray call round trip costs more than a small decode step).

A worker that dies ends every in-flight step with `WorkerFailure` within seconds (its
`run_loop` call fails, which `execute_model` watches while it waits); the engine then fails
its requests and refuses new ones — it never hangs.
"""

from __future__ import annotations

import os
import re
import time

from kvloom.cluster.config import EngineConfig
from kvloom.cluster.scheduler_output import ModelRunnerOutput, SchedulerOutput
from kvloom.cluster.step_channel import ResultChannel, StepPublisher

POLL_S = 0.2
PLACEMENT_TIMEOUT_S = float(os.environ.get("KVLOOM_PLACEMENT_TIMEOUT_S", "120"))


class WorkerFailure(RuntimeError):
    """A worker actor died or raised; the message says which and why."""


def _first_line(err: Exception) -> str:
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(err)).strip()
    return text.splitlines()[0] if text else type(err).__name__


def connect_ray(num_cpus_for_local: int) -> None:
    """Joins RAY_ADDRESS's cluster, or starts an embedded local Ray."""
    import ray

    if ray.is_initialized():
        return
    address = os.environ.get("RAY_ADDRESS")
    # gRPC's C core logs at INFO when Ray forks under a live channel; keep it quiet.
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    if address:
        ray.init(address=address, log_to_driver=True)
    else:
        # Ray gives its GCS 30 s to bind a port; a busy small machine (CI's 2 cores under a
        # test run) was seen to need more. The variable stays the operator's to set.
        os.environ.setdefault("RAY_gcs_server_port_wait_time_s", "120")
        ray.init(num_cpus=num_cpus_for_local, include_dashboard=False, log_to_driver=True)


class RayExecutor:
    def __init__(self, config: EngineConfig, progress: bool = True):
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from kvloom.workers.ray_worker import WorkerActor

        self.config = config
        world = config.parallel.world_size
        # CPU slots of an embedded Ray are logical: enough for any grid we start here.
        connect_ray(num_cpus_for_local=max(16, world + 1))
        gpus = ray.cluster_resources().get("GPU", 0)
        self.use_gpu = config.device == "cuda" or (config.device == "auto" and gpus >= world)
        bundle = {"GPU": 1, "CPU": 1} if self.use_gpu else {"CPU": 1}
        self.placement_group = placement_group([bundle] * world, strategy="STRICT_PACK")
        try:
            ray.get(self.placement_group.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(self.placement_group)
            raise ValueError(
                f"tensor_parallel_size × decode_context_parallel_size = {world} needs {world} "
                f"bundles of {bundle} on one node; the Ray cluster has "
                f"{ray.available_resources()} available"
            ) from None
        actor_class = ray.remote(max_concurrency=2)(WorkerActor)
        self.actors = [
            actor_class.options(
                num_cpus=1,
                num_gpus=1 if self.use_gpu else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.placement_group, placement_group_bundle_index=rank
                ),
            ).remote(config, rank, self.use_gpu, progress and rank == 0)
            for rank in range(world)
        ]
        self.publisher = self.results = None
        self.loop_refs: list = []
        try:
            init_address = ray.get(self.actors[0].node_address.remote())
            self._call_all("setup", init_address)
        except Exception:
            self.shutdown()
            raise
        self.kv_cache_groups = ray.get(self.actors[0].kv_cache_groups.remote())
        host = ray.util.get_node_ip_address()
        self.publisher = StepPublisher(world, host=host)
        self.results = ResultChannel(msg_type=ModelRunnerOutput, host=host)
        self.failure: str | None = None

    def _call_all(self, method: str, *args):
        import ray

        try:
            return ray.get([getattr(a, method).remote(*args) for a in self.actors])
        except ray.exceptions.RayTaskError as err:
            if isinstance(err.cause, ValueError):  # bad configuration: say it as such
                raise ValueError(str(err.cause)) from None
            raise WorkerFailure(f"worker call {method} failed: {_first_line(err)}") from err
        except ray.exceptions.RayError as err:
            raise WorkerFailure(f"worker call {method} failed: {_first_line(err)}") from err

    def determine_num_blocks(self) -> int:
        return min(self._call_all("determine_num_blocks"))

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self._call_all("initialize_kv_cache", num_blocks)
        self.loop_refs = [
            a.run_loop.remote(self.publisher.address, self.results.address) for a in self.actors
        ]

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
            try:
                ray.get(ref)
                failed.append(f"rank {rank}: its step loop ended")
            except ray.exceptions.ActorDiedError as err:
                died.append(f"rank {rank} died ({_first_line(err)})")
            except ray.exceptions.RayError as err:
                failed.append(f"rank {rank}: {_first_line(err)}")
        self.failure = "worker " + "; ".join(died + failed)
        raise WorkerFailure(self.failure)

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        if self.failure:
            raise WorkerFailure(self.failure)
        self.publisher.publish(sched)
        while True:
            try:
                return self.results.recv(timeout=POLL_S)
            except TimeoutError:
                self._check_workers()

    def shutdown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

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
            remove_placement_group(self.placement_group)
