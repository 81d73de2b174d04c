"""A worker: one device's model runner. The in-process executor holds one directly; the
Ray executor hosts one per device in an actor."""

from __future__ import annotations

import torch

from kvloom.cluster.config import EngineConfig
from kvloom.cluster.kv_cache.spec import KVCacheGroup
from kvloom.cluster.scheduler_output import ModelRunnerOutput, SchedulerOutput
from kvloom.workers.layers.tp_group import CoordinatorTPGroup
from kvloom.workers.model_runner import ModelRunner


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

    @property
    def kv_cache_groups(self) -> list[KVCacheGroup]:
        return self.runner.groups

    def determine_num_blocks(self) -> int:
        return self.runner.num_blocks_for_budget()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.runner.initialize_kv_cache(num_blocks)

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute(sched)
