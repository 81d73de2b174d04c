"""A worker: one device's model runner. The in-process executor holds one directly; the
Ray executor hosts one per device in an actor."""

from __future__ import annotations

import torch

from kvloom.contracts.config import EngineConfig
from kvloom.contracts.kv_cache_plan import KVCacheMemory, KVCachePlan, KVCacheSpecs
from kvloom.contracts.runner_output import ModelRunnerOutput
from kvloom.contracts.scheduler_output import GrammarBitmasks, SchedulerOutput
from kvloom.workers.layers.tp_group import CoordinatorTPGroup
from kvloom.workers.model_runner import ModelRunner
from kvloom.workers.pending_step import PendingStep


def pick_device(requested: str) -> torch.device:
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ValueError("device must be cpu or auto on a machine without CUDA, got 'cuda'")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class Worker:
    """`parallel` is this rank's ParallelState (workers/distributed/process_group.py);
    None means a single rank."""

    def __init__(
        self,
        config: EngineConfig,
        parallel=None,
        progress: bool = True,
        device: torch.device | None = None,
    ):
        self.config = config
        self.device = device or pick_device(config.device)
        self.parallel = parallel
        tp = CoordinatorTPGroup(parallel.tp) if parallel is not None else None
        dcp = parallel.dcp if parallel is not None else None
        self.runner = ModelRunner(config, self.device, tp, dcp)
        self.runner.load_model(progress=progress)

    # KV cache, planned by the control plane (contracts/kv_cache_plan.py): this worker
    # reports its layers' specs, then its memory under the plan, then allocates the plan.
    def kv_cache_specs(self) -> KVCacheSpecs:
        return self.runner.kv_cache_specs()

    def available_kv_memory(self, plan: KVCachePlan) -> KVCacheMemory:
        self.runner.apply_kv_cache_plan(plan)
        return self.runner.available_kv_memory()

    def initialize_kv_cache(self, plan: KVCachePlan, num_blocks: int) -> None:
        self.runner.apply_kv_cache_plan(plan)
        self.runner.initialize_kv_cache(num_blocks)

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute(sched)

    def submit(self, sched: SchedulerOutput) -> PendingStep:
        """Launches the step; `.result()` on the returned handle reads its output back."""
        return self.runner.submit(sched)

    def supply_bitmasks(self, masks: GrammarBitmasks) -> None:
        """The grammar masks the step launched last waits for (async scheduling)."""
        self.runner.supply_bitmasks(masks)
