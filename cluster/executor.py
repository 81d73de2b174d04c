"""Executors run scheduled steps on workers. All share this interface; the in-process
one (TP = DCP = 1, no Ray) holds the worker in the engine's own process."""

from __future__ import annotations

from typing import Protocol

from kvloom.contracts.config import EngineConfig
from kvloom.contracts.kv_cache_plan import KVCacheMemory, KVCachePlan, KVCacheSpecs
from kvloom.contracts.runner_output import ModelRunnerOutput
from kvloom.contracts.scheduler_output import GrammarBitmasks, SchedulerOutput


class Executor(Protocol):
    """KV cache set-up (the engine plans it, cluster/kv_cache/planner.py): the workers
    report their layers' specs, then the memory they can give the cache under the plan;
    then they allocate the plan's pages for `num_blocks` blocks."""

    def kv_cache_specs(self) -> KVCacheSpecs: ...

    def available_kv_memory(self, plan: KVCachePlan) -> KVCacheMemory: ...

    def initialize_kv_cache(self, plan: KVCachePlan, num_blocks: int) -> None: ...

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput: ...

    def shutdown(self) -> None: ...


class InProcessExecutor:
    def __init__(self, config: EngineConfig, progress: bool = True):
        from kvloom.workers.worker import Worker  # data plane, imported only here

        self.worker = Worker(config, progress=progress)

    def kv_cache_specs(self) -> KVCacheSpecs:
        return self.worker.kv_cache_specs()

    def available_kv_memory(self, plan: KVCachePlan) -> KVCacheMemory:
        return self.worker.available_kv_memory(plan)

    def initialize_kv_cache(self, plan: KVCachePlan, num_blocks: int) -> None:
        self.worker.initialize_kv_cache(plan, num_blocks)

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(sched)

    def submit(self, sched: SchedulerOutput):
        """Launches the step; `.result()` on the returned handle waits for its output."""
        return self.worker.runner.submit(sched)

    def send_bitmasks(self, masks: GrammarBitmasks) -> None:
        """The grammar masks of the step submitted last (its rows' masks followed it)."""
        self.worker.supply_bitmasks(masks)

    @property
    def device_type(self) -> str:
        return self.worker.device.type

    def shutdown(self) -> None:
        self.worker = None


def make_executor(config: EngineConfig, progress: bool = True) -> Executor:
    """In-process for one rank (unless executor="ray"); Ray for a TP × DCP grid."""
    parallel = config.parallel
    if parallel.executor == "ray" or parallel.world_size > 1:
        if parallel.executor == "inprocess":
            raise ValueError(
                "executor='inprocess' runs one rank; tensor_parallel_size × "
                "decode_context_parallel_size > 1 needs executor='ray' or 'auto'"
            )
        from kvloom.cluster.ray_executor import RayExecutor

        return RayExecutor(config, progress=progress)
    return InProcessExecutor(config, progress=progress)
