"""The worker as a Ray actor: one per device, in a placement-group bundle.

Ray starts it, and Ray calls set it up (load, KV sizing) and health-check it. Steps do not
travel as Ray calls: `run_loop` reads each SchedulerOutput from the zmq step channel, runs
it, and world rank 0 (the driver worker, which samples) sends the ModelRunnerOutput back
over the result channel.
"""

from __future__ import annotations

import os
import socket

import torch

from kvloom.cluster.config import EngineConfig
from kvloom.cluster.gc_freeze import freeze_startup_objects
from kvloom.cluster.scheduler_output import SchedulerOutput
from kvloom.cluster.step_channel import ChannelClosed, ResultSender, StepSubscriber
from kvloom.workers.distributed.process_group import RankLayout, init_parallel_state
from kvloom.workers.worker import Worker


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class WorkerActor:
    def __init__(self, config: EngineConfig, rank: int, use_gpu: bool, progress: bool = False):
        self.config = config
        self.progress = progress
        self.rank = rank
        self.use_gpu = use_gpu
        self.layout = RankLayout(
            config.parallel.tensor_parallel_size, config.parallel.decode_context_parallel_size
        )
        if not use_gpu:
            # One CPU slot per rank: keep torch from oversubscribing the cores.
            torch.set_num_threads(max(1, int(os.environ.get("KVLOOM_WORKER_THREADS", "1"))))
        self.worker: Worker | None = None

    def node_address(self) -> str:
        """A tcp:// address on this actor's node for torch.distributed to rendezvous."""
        import ray

        return f"tcp://{ray.util.get_node_ip_address()}:{free_port()}"

    def setup(self, init_address: str) -> None:
        device = torch.device("cuda", 0) if self.use_gpu else torch.device("cpu")
        parallel = init_parallel_state(self.layout, self.rank, init_address, device)
        self.worker = Worker(self.config, parallel, progress=self.progress, device=device)

    def kv_cache_groups(self):
        return self.worker.kv_cache_groups

    def determine_num_blocks(self) -> int:
        return self.worker.determine_num_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.worker.initialize_kv_cache(num_blocks)
        freeze_startup_objects()  # the worker process is fully built now

    def health(self) -> bool:
        return self.worker is not None

    def run_loop(self, step_address: str, result_address: str) -> int:
        """Runs steps until the scheduler closes the channel; returns the steps run."""
        subscriber = StepSubscriber(step_address, msg_type=SchedulerOutput)
        sender = ResultSender(result_address, rank=self.rank) if self.rank == 0 else None
        steps = 0
        try:
            while True:
                try:
                    sched = subscriber.recv()
                except ChannelClosed:
                    return steps
                out = self.worker.execute_model(sched)
                steps += 1
                if sender is not None:
                    sender.send(out)
        finally:
            subscriber.close()
            if sender is not None:
                sender.close()
            if self.worker is not None and self.worker.parallel is not None:
                self.worker.parallel.destroy()
